"""Balance the units across the pipeline's stages: measure what each unit costs, split them
exactly (the smallest largest-stage cost over all contiguous splits, a dynamic program), and
predict which micro-batch count gives the shortest step. How and why: the user guide's "The
model: `spec.model`" (the cut) and "Micro-batches" (`microBatches: auto`)."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from pipejob.trainer.workloads.batch_values import tensors

# Splits whose slowest stage is within this fraction of the fastest split's count as equally
# fast: the measured costs of equal units differ by a few percent on idle cores, and by more
# where other work shares them.
COST_SLACK = 0.1


def min_max_partition(
    costs: Sequence[float],
    pieces: int,
    sizes: Sequence[float] | None = None,
    starts: Sequence[bool] | None = None,
) -> list[range]:
    """Split units 0..n-1 into `pieces` non-empty contiguous ranges, minimising the largest
    range's total cost; with `sizes` (each unit's parameter bytes), of the splits within
    COST_SLACK of that, the one minimising the largest range's bytes; with `starts`, only
    splits whose ranges each begin at a unit marked True. Among equally good splits,
    earlier pieces get fewer units."""
    n = len(costs)
    if pieces < 1:
        raise ValueError(f"need at least one piece, got {pieces}")
    if n < pieces:
        raise ValueError(f"cannot split {n} units into {pieces} non-empty pieces")
    if any(c < 0 for c in costs):
        raise ValueError("unit costs must not be negative")
    if sizes is not None and len(sizes) != n:
        raise ValueError(f"{len(sizes)} unit sizes for {n} unit costs")
    starts = [True] * n if starts is None else [True, *starts[1:]]
    if sum(starts) < pieces:
        raise ValueError(f"only {sum(starts)} of {n} units may begin a piece, for {pieces}")
    fastest, bounds = _min_max(costs, pieces, float("inf"), starts)
    if sizes is None:
        return bounds
    return _min_max(sizes, pieces, fastest * (1 + COST_SLACK), starts, costs)[1]


def _min_max(
    weights: Sequence[float],
    pieces: int,
    bound: float,
    starts: Sequence[bool],
    costs: Sequence[float] | None = None,
) -> tuple[float, list[range]]:
    """The split of the units into `pieces` ranges minimising the largest range's total
    weight, of those whose ranges each begin where `starts` allows and cost at most `bound`
    (`costs`: per unit), and that largest weight."""
    n = len(weights)
    weight, cost = _prefix(weights), _prefix(weights if costs is None else costs)
    inf = float("inf")
    # best[k][i]: the smallest possible largest weight when the first i units form k
    # pieces; cut[k][i]: where the last of those k pieces starts in such a split.
    best = [[inf] * (n + 1) for _ in range(pieces + 1)]
    cut = [[0] * (n + 1) for _ in range(pieces + 1)]
    best[0][0] = 0.0
    for k in range(1, pieces + 1):
        for i in range(k, n - (pieces - k) + 1):
            for s in range(k - 1, i):  # the last piece is units s..i-1
                if not starts[s] or cost[i] - cost[s] > bound:
                    continue
                worst = max(best[k - 1][s], weight[i] - weight[s])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, s
    bounds = [n]
    for k in range(pieces, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return best[pieces][n], [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def _prefix(values: Sequence[float]) -> list[float]:
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return sums


@dataclass(frozen=True)
class UnitCosts:
    """Forward + backward of one micro-batch, per unit."""

    seconds: list[float]  # wall-clock: how long a stage computing alone takes
    cpu_seconds: list[float]  # CPU time of all threads: what it takes from shared cores
    sizes: list[float] | None = None  # parameter bytes, where known: the split's tie-break
    # Per unit, whether all it passes on are tensors (torch's PipelineStages send only them)
    passes_tensors: list[bool] | None = None
    # Counted (counted_cost.py: FLOPs and bytes, spec.deterministic) rather than timed: then
    # `seconds` and `cpu_seconds` hold the count, and only their ratios mean anything.
    counted: bool = False


def measure_costs(
    pieces: list[nn.Module], names: list[str], sample: torch.Tensor, repeats: int = 3
) -> UnitCosts:
    """What each piece of the model (cut at every candidate, cut.Traced) costs for forward
    + backward on `sample` (a micro-batch of the model's input): `measure_chain` from the
    model's input."""
    return measure_chain(pieces, names, (sample,), True, repeats)[0]


def measure_chain(
    pieces: list[nn.Module],
    names: list[str],
    values: tuple[Any, ...],
    first: bool,
    repeats: int = 3,
    on_copies: bool = True,
) -> tuple[UnitCosts, tuple[Any, ...]]:
    """What each of a run of consecutive pieces costs for forward + backward on `values`
    (what the model passes the first of them; the model's own input when `first`), the
    minimum over `repeats` runs after one untimed warm-up run (first calls set up kernels
    and memory); and what the last piece passes on, detached, for the next run of pieces.
    Runs `on_copies` so the model's BatchNorm statistics and gradients stay untouched
    (pieces built only to be measured need none). A piece that fails on what it is given
    (the data does not fit the model) is a ValueError saying both."""
    if on_copies:
        pieces = copy.deepcopy(pieces)
    costs = [float("inf")] * len(pieces)
    cpu = [float("inf")] * len(pieces)
    passes_tensors = [True] * len(pieces)
    given = values
    for run in range(repeats + 1):
        values = given
        for i, (name, piece) in enumerate(zip(names, pieces, strict=True)):
            # Only the model's input needs no gradient; every later piece computes one for
            # its inputs, as in training. The clone lets in-place modules (ReLU) run.
            inputs = tuple(as_input(v, i > 0 or not first) for v in values)
            on_gpu = any(t.is_cuda for t in tensors(inputs))
            if on_gpu:
                torch.cuda.synchronize()  # the time of this piece's kernels alone
            start, start_cpu = time.perf_counter(), time.process_time()
            outs = forward_backward(piece, inputs, name, i == 0 and first)
            if on_gpu:
                torch.cuda.synchronize()
            if run > 0:
                costs[i] = min(costs[i], time.perf_counter() - start)
                cpu[i] = min(cpu[i], time.process_time() - start_cpu)
            passes_tensors[i] = all(isinstance(v, torch.Tensor) for v in outs)
            values = outs
    passed = tree_map_only(torch.Tensor, torch.Tensor.detach, values)
    return UnitCosts(costs, cpu, passes_tensors=passes_tensors), passed


def forward_backward(
    piece: nn.Module, inputs: tuple[Any, ...], name: str, model_input: bool
) -> tuple[Any, ...]:
    """One forward + backward of `piece` on `inputs` (`model_input`: the data's), its
    gradients dropped after; what it passes on. A piece that fails on what it is given (the
    data does not fit the model) is a ValueError saying both."""
    try:
        out = piece(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        grown = [t for t in tensors(outs) if t.requires_grad]
        # Each output's gradient all ones, as a sum's: explicit gradient tensors would make
        # torch import sympy into the stage for their shape checks (0.04 GB a process, for good).
        torch.autograd.backward([t.sum() for t in grown])
        piece.zero_grad(set_to_none=True)  # one piece's gradients held at a time
    except RuntimeError as e:
        shapes = ", ".join(shape(v) for v in inputs)
        what = "the data's input" if model_input else "its input"
        raise ValueError(f"{name} cannot process {what} of shape {shapes}: {e}") from None
    return outs


def as_input(value: Any, grad: bool) -> Any:
    """A value passed between pieces, a fresh leaf of the graph (tensors inside tuples,
    lists and dicts too: a UNet passes its skip connections on as a tuple)."""
    return tree_map_only(torch.Tensor, lambda v: _leaf(v, grad), value)


def _leaf(value: torch.Tensor, grad: bool) -> torch.Tensor:
    value = value.detach()
    if grad and value.is_floating_point():
        return value.requires_grad_().clone()
    return value


def shape(value: Any) -> str:
    """A value as an error message shows it: (32, 3, 224, 224) float32; inside tuples,
    lists and dicts too."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(shape(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {shape(v)}" for k, v in value.items()) + "}"
    return repr(value)


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Compute with `threads` intra-op threads inside the block (None: as it is), then with
    as many as before: costs measured for the stages must use the stages' thread count."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class Host:
    """Stages whose processes share one machine's cores, and how many cores that is; or,
    with `gpu`, stages that share one GPU (`cpus` 1): it runs one process's kernels at a time,
    so their time on it adds up."""

    stages: tuple[int, ...]
    cpus: float
    gpu: bool = False


@dataclass(frozen=True)
class Prediction:
    """A micro-batch count's balanced split and its predicted step time."""

    micro_batches: int
    micro_batch_size: int
    ranges: list[range]
    pipeline_seconds: float  # GPipe's schedule, every stage computing at its own pace
    cores_seconds: float  # the stages' CPU time over the cores they share (or GPU time)
    # Predicted from counted costs (counted_cost.predict_counted): the two bounds hold counts.
    counted: bool = False

    @property
    def step_seconds(self) -> float:
        """Of the whole batch's forwards and backwards: the tighter of the two bounds."""
        return max(self.pipeline_seconds, self.cores_seconds)

    @property
    def samples_per_second(self) -> float:
        return self.micro_batches * self.micro_batch_size / self.step_seconds


def predict(
    costs: UnitCosts,
    stages: int,
    micro_batches: int,
    batch: int,
    hosts: Sequence[Host] = (),
    ranges: list[range] | None = None,
    per_process: int = 1,
    starts: Sequence[bool] | None = None,
    overhead: float = 0.0,
) -> Prediction:
    """Split `costs` (per unit, one micro-batch of batch // micro_batches) over `stages` by
    wall-clock time (over stages x `per_process` pieces, process k holding pieces k,
    k + stages, ..., for an interleaved schedule) and predict the step from two lower bounds:
    - the schedule: GPipe with a flush every step takes m + p - 1 slots of the slowest stage,
      m of them its own work and p - 1 the pipeline's fill and drain (1F1B's too; an
      interleaved schedule's slots are pieces: m x per_process + p - 1 of the slowest);
    - the cores: stages sharing a host compute at once only as far as its cores go, so the
      host needs at least their CPU time over its cores. It is what makes small micro-batches
      lose where stages share cores: a stage idle in the bubble lends the others its cores,
      while small micro-batches cost more CPU time per sample. Stages sharing a GPU need at
      least the sum of their times on it.
    `ranges` given (spec.splitPoints): that split, predicted, instead of the balanced one;
    `starts`: per unit, whether a piece may begin there; `overhead`: what each slot costs
    beyond its units (timed costs hold their own; counted ones do not: counted_cost.py)."""
    pieces = stages * per_process
    ranges = ranges or min_max_partition(costs.seconds, pieces, costs.sizes, starts)
    slowest = max(sum(costs.seconds[i] for i in r) for r in ranges)
    crowded = (
        micro_batches
        * sum(
            (costs.seconds if host.gpu else costs.cpu_seconds)[i]
            for k in range(len(ranges))
            if k % stages in host.stages
            for i in ranges[k]
        )
        / host.cpus
        for host in hosts
    )
    pipelined = (micro_batches * per_process + stages - 1) * (slowest + overhead)
    return Prediction(
        micro_batches,
        batch // micro_batches,
        ranges,
        pipelined,
        max(crowded, default=0.0),
        costs.counted,
    )


def fastest(predictions: Sequence[Prediction]) -> Prediction:
    """The shortest predicted step; on a tie the fewer micro-batches (less per-call overhead)."""
    return min(predictions, key=lambda p: (p.step_seconds, p.micro_batches))
