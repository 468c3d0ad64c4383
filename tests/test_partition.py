"""Cutting torchvision models into layers, and balancing layers across stages."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn
from torchvision.models import get_model

from pipejob.core.kinds.pipeline import auto_counts, micro_batch_counts
from pipejob.trainer.pipeline.balance import (
    COST_SLACK,
    Host,
    UnitCosts,
    fastest,
    intra_op_threads,
    measure_chain,
    measure_costs,
    min_max_partition,
    predict,
)
from pipejob.trainer.workloads.cut import Traced

# One model per torchvision family the trainer cuts, with an input size it can take.


def brute_force(costs: list[float], parts: int, starts: list[bool] | None = None) -> float:
    """The smallest largest stage cost over every contiguous split (whose stages begin only
    where `starts` allows)."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        if starts is not None and not all(starts[c] for c in cuts):
            continue
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_partition_is_the_exact_min_max_split():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        costs = [rng.choice([0.0, rng.random(), rng.randint(1, 5)]) for _ in range(n)]
        ranges = min_max_partition(costs, parts)
        assert len(ranges) == parts
        assert all(len(r) > 0 for r in ranges), ranges
        assert [i for r in ranges for i in r] == list(range(n))  # contiguous, in order, all
        worst = max(sum(costs[i] for i in r) for r in ranges)
        assert worst == pytest.approx(brute_force(costs, parts)), (costs, parts, ranges)


def test_partition_begins_stages_only_where_allowed():
    """The exact min-max split of those whose stages begin at layers marked in `starts`
    (the pipelining engine's: where the model passes only tensors); too few marked, refused."""
    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        starts = [True, *(rng.random() < 0.6 for _ in range(n - 1))]
        costs = [rng.choice([0.0, rng.random(), rng.randint(1, 5)]) for _ in range(n)]
        if sum(starts) < parts:
            with pytest.raises(ValueError, match=f"of {n} units may begin a piece"):
                min_max_partition(costs, parts, starts=starts)
            continue
        for sizes in (None, [rng.random() for _ in range(n)]):
            ranges = min_max_partition(costs, parts, sizes, starts)
            assert [i for r in ranges for i in r] == list(range(n)) and all(ranges)
            assert all(starts[r.start] for r in ranges), (starts, ranges)
            best = brute_force(costs, parts, starts) * (1 if sizes is None else 1 + COST_SLACK)
            assert largest(costs, ranges) <= best + 1e-9, (costs, starts, ranges)


def test_partition_examples():
    assert min_max_partition([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert min_max_partition([5, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]
    assert min_max_partition([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [
        range(0, 5),
        range(5, 7),
        range(7, 9),
    ]
    assert min_max_partition([3.0], 1) == [range(0, 1)]


def largest(values: list[float], ranges: list[range]) -> float:
    return max(sum(values[i] for i in r) for r in ranges)


def test_with_sizes_the_split_holds_the_fewest_bytes_among_the_fast_enough():
    """Of the splits whose slowest stage is within COST_SLACK of the fastest split's, the one
    whose largest stage holds the fewest bytes (checked against every split)."""
    rng = random.Random(11)
    for _ in range(300):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        costs = [rng.choice([0.0, rng.random(), rng.randint(1, 5)]) for _ in range(n)]
        sizes = [rng.choice([0.0, rng.random(), rng.randint(1, 5)]) for _ in range(n)]
        ranges = min_max_partition(costs, parts, sizes)
        assert [i for r in ranges for i in r] == list(range(n)) and all(ranges)
        bound = brute_force(costs, parts) * (1 + COST_SLACK)
        assert largest(costs, ranges) <= bound + 1e-9, (costs, sizes, parts, ranges)
        fewest = min(
            largest(sizes, [range(a, b) for a, b in itertools.pairwise((0, *cuts, n))])
            for cuts in itertools.combinations(range(1, n), parts - 1)
            if largest(costs, [range(a, b) for a, b in itertools.pairwise((0, *cuts, n))])
            <= bound + 1e-9
        )
        assert largest(sizes, ranges) == pytest.approx(fewest), (costs, sizes, parts, ranges)


def test_equal_blocks_measured_unevenly_get_equal_bytes():
    """24 equal blocks (a cheap embedding before them, a cheap head after), measured in runs
    of 6 by the 4 stage processes, the first 10% fast and the second 10% slow (other work on
    the cores): by cost alone the first stage gets 7 blocks and the second 5; with the
    blocks' sizes each stage holds 6, at a cost within COST_SLACK of the fastest split's."""
    costs = [0.02, *(factor for factor in (0.9, 1.1, 1.0, 1.0) for _ in range(6)), 0.03]
    sizes = [0.1, *[1.0] * 24, 0.1]

    def blocks(ranges: list[range]) -> list[int]:
        return [len(r) - (r.start == 0) - (r.stop == len(costs)) for r in ranges]

    assert blocks(min_max_partition(costs, 4)) == [7, 5, 6, 6]
    assert blocks(min_max_partition(costs, 4, sizes)) == [6, 6, 6, 6]


def test_partition_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="cannot split 3 units into 4 non-empty pieces"):
        min_max_partition([1, 1, 1], 4)
    with pytest.raises(ValueError, match="at least one piece"):
        min_max_partition([1, 1], 0)
    with pytest.raises(ValueError, match="negative"):
        min_max_partition([1, -1], 2)
    with pytest.raises(ValueError, match="2 unit sizes for 3 unit costs"):
        min_max_partition([1, 1, 1], 2, [1, 1])


def test_measured_costs_leave_the_model_untouched():
    torch.manual_seed(0)
    model = get_model("resnet18", weights=None, num_classes=10)
    traced = Traced(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pieces = traced.split(traced.units[1:])
    measured = measure_costs(pieces, traced.units, torch.randn(2, 3, 32, 32), repeats=2)
    costs = measured.seconds
    assert len(costs) == len(measured.cpu_seconds) == len(traced.units)
    assert all(c > 0 for c in costs)
    assert sum(measured.cpu_seconds) > 0
    by_name = dict(zip(traced.units, costs, strict=True))
    assert by_name["layer1.0"] > by_name["relu"]  # a residual block costs more than a ReLU
    after = model.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key  # BatchNorm statistics included
    assert all(p.grad is None for p in model.parameters())


def test_a_part_that_cannot_take_the_input_is_named_with_the_shapes():
    torch.manual_seed(0)
    traced = Traced(get_model("alexnet", weights=None, num_classes=10))
    pieces = traced.split(traced.units[1:])
    with pytest.raises(
        ValueError,
        match=r"features\.\S+ cannot process its input of shape"
        r" \(1, \d+, \d+, \d+\) float32",
    ):
        measure_costs(pieces, traced.units, torch.randn(1, 3, 32, 32), repeats=1)
    with pytest.raises(
        ValueError,
        match=r"features\.0 cannot process the data's input of"
        r" shape \(1, 5, 64, 64\) float32",
    ):
        measure_costs(pieces, traced.units, torch.randn(1, 5, 64, 64), repeats=1)


# ------------------------------------------------------------------ microBatches: auto


@pytest.mark.parametrize(
    ("batch", "counts"),
    [
        (48, [1, 2, 4, 8, 16]),
        (32, [1, 2, 4, 8, 16]),
        (64, [1, 2, 4, 8, 16, 32]),
        (30, [1, 2]),
        (15, [1]),
        (4, [1, 2]),
        (2, [1]),
        (1, [1]),
    ],
)
def test_auto_tries_powers_of_two_with_micro_batches_of_two_or_more(batch, counts):
    assert micro_batch_counts(batch) == counts


@pytest.mark.parametrize(
    ("schedule", "stages", "counts"),
    [
        ("gpipe", 4, [1, 2, 4, 8]),
        ("1f1b", 4, [4, 8]),
        ("1f1b", 3, [4, 8]),
        ("interleaved-1f1b", 2, [2, 4, 8]),
        ("zero-bubble", 4, [4, 8]),
        ("zero-bubble", 3, []),
    ],
)
def test_auto_measures_only_the_counts_the_schedule_can_run(schedule, stages, counts):
    assert auto_counts(16, schedule, stages) == counts


def test_an_interleaved_schedule_is_predicted_over_its_pieces():
    """4 equal layers on 2 processes of 2 pieces each (process k: pieces k and k + 2): the
    pieces' slots are m x 2 + p - 1 of the slowest piece (one layer), and a host's CPU time
    counts every piece of its processes."""
    p = predict(uniform([1.0] * 4), 2, 4, 8, [Host((0,), 1.0)], per_process=2)
    assert p.ranges == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert p.pipeline_seconds == (4 * 2 + 1) * 1.0
    assert p.cores_seconds == 4 * (1.0 + 1.0)  # pieces 0 and 2, every micro-batch


def uniform(per_layer: list[float]) -> UnitCosts:
    """Costs of a layer that keeps its threads busy: CPU time equals wall-clock time."""
    return UnitCosts(per_layer, per_layer)


def test_auto_picks_the_count_with_the_shortest_predicted_step():
    """Each of 4 layers costs 1 (per call) + 1 per sample: on 2 stages with cores of their
    own, a step of m micro-batches of 16 / m takes (m + 1) * 2 * (1 + 16 / m) =
    2 (m + 17 + 16 / m), shortest at m = 4 (50): fewer micro-batches leave a larger bubble,
    more pay the per-call cost more often."""
    batch, counts = 16, micro_batch_counts(16)
    costs = {m: uniform([1 + batch / m] * 4) for m in counts}
    predictions = [predict(costs[m], 2, m, batch) for m in counts]
    assert [p.step_seconds for p in predictions] == [68, 54, 50, 54]  # m = 1, 2, 4, 8
    chosen = fastest(predictions)
    assert (chosen.micro_batches, chosen.micro_batch_size) == (4, 4)
    assert chosen.ranges == [range(0, 2), range(2, 4)] and chosen.pipeline_seconds == 50
    assert chosen.samples_per_second == pytest.approx(16 / 50)
    # Two cores for both stages do not slow them: their bound 2m + 32 < 2 (m + 17 + 16 / m).
    two = [predict(costs[m], 2, m, batch, [Host((0, 1), 2)]) for m in counts]
    assert fastest(two).micro_batches == 4
    # On one core they compute one at a time: pipelining gains nothing and every extra
    # micro-batch costs CPU time (4m + 64), so one micro-batch is fastest.
    one = [predict(costs[m], 2, m, batch, [Host((0, 1), 1)]) for m in counts]
    assert [p.cores_seconds for p in one] == [68, 72, 80, 96]
    assert [p.step_seconds for p in one] == [68, 72, 80, 96]
    assert fastest(one).micro_batches == 1


def test_the_cores_bound_counts_only_the_stages_sharing_a_host():
    costs = UnitCosts([1, 1, 1, 1], [2, 2, 2, 2])  # two threads busy per layer
    alone = predict(costs, 2, 2, 8, [Host((0,), 4), Host((1,), 4)])
    assert (alone.pipeline_seconds, alone.cores_seconds) == (6, 2)  # 2 * (2 + 2) / 4
    shared = predict(costs, 2, 2, 8, [Host((0, 1), 2)])
    assert (shared.pipeline_seconds, shared.cores_seconds) == (6, 8)  # 2 * 8 / 2
    assert shared.step_seconds == 8


def test_stages_sharing_a_gpu_add_up_their_time_on_it():
    """Two stages on one GPU (the local runner's placement with fewer GPUs than stages) run
    one at a time: the bound is the sum of their device times, whatever the CPU time (a GPU
    stage's host thread mostly waits). Per-micro-batch costs that fall more slowly than the
    micro-batch (launches, small kernels) make one micro-batch fastest there, where GPUs of
    their own would take four."""
    batch, counts = 16, micro_batch_counts(16)
    costs = {m: UnitCosts([1 + batch / m] * 4, [0.1] * 4) for m in counts}
    own = [
        predict(costs[m], 2, m, batch, [Host((0,), 1, gpu=True), Host((1,), 1, gpu=True)])
        for m in counts
    ]
    assert fastest(own).micro_batches == 4
    one = [predict(costs[m], 2, m, batch, [Host((0, 1), 1, gpu=True)]) for m in counts]
    assert [p.cores_seconds for p in one] == [68, 72, 80, 96]  # m (4 layers x (1 + 16/m))
    assert fastest(one).micro_batches == 1


def test_each_count_is_split_by_its_own_costs():
    """The last layer degrades at small micro-batches (as ResNet's late blocks do): at one
    micro-batch the split is 2 + 2 layers; at 4, the last layer gets a stage of its own."""
    big = predict(uniform([4, 4, 4, 4]), 2, 1, 8)
    small = predict(uniform([1, 1, 1, 3]), 2, 4, 8)
    assert big.ranges == [range(0, 2), range(2, 4)]
    assert small.ranges == [range(0, 3), range(3, 4)]
    assert (big.step_seconds, small.step_seconds) == (16, 15)
    assert fastest([big, small]) is small


def test_a_tie_goes_to_fewer_micro_batches():
    a, b = predict(uniform([3, 3]), 2, 1, 4), predict(uniform([2, 2]), 2, 2, 4)  # 2*3 == 3*2
    assert a.step_seconds == b.step_seconds
    assert fastest([b, a]) is a


def test_costs_are_measured_with_the_threads_asked_for():
    before = torch.get_num_threads()
    with intra_op_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), intra_op_threads(before + 2):
        raise RuntimeError("measurement failed")
    assert torch.get_num_threads() == before  # restored on failure too
    with intra_op_threads(None):
        assert torch.get_num_threads() == before


class Skips(nn.Module):
    """A UNet's down block: its output and its skip connections, as a tuple in a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        h = self.a(x)
        return self.b(h), (h, x * 2)


class Joins(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, skips: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.c(h + skips[0] + skips[1])


def test_measuring_pieces_that_pass_tensors_inside_tuples_repeats_each_backward():
    """Every run's inputs are fresh leaves, the ones inside a tuple too (a UNet's skip
    connections once kept the last run's graph: 'backward through the graph a second time');
    what the run passes on is detached, inside tuples too."""
    costs, passed = measure_chain(
        [Skips(), Joins()],
        ["down", "up"],
        (torch.randn(2, 4),),
        first=True,
        repeats=2,
        on_copies=False,
    )
    assert len(costs.seconds) == 2 and all(c < float("inf") for c in costs.seconds)
    assert all(not t.requires_grad for t in passed)
    _, passed = measure_chain([Skips()], ["down"], (torch.randn(2, 4),), True, 1, False)
    h, skips = passed
    assert not h.requires_grad and all(not t.requires_grad for t in skips)
