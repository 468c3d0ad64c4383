"""spec.deterministic's cut (issue 57): counted, not timed (pipeline/counted_cost.py), so two
runs of one manifest cut the model alike on a busy machine, and the eager path places its
modules alike; `microBatches: auto` chooses its count from the counts too."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from test_determinism import assert_same_bits, lm_job
from torch import nn
from userdata import write_stdlib_tokens

from jobrun import pipeline_job, run_to_end
from pipejob.core import spec
from pipejob.core.kinds.pipeline import auto_counts
from pipejob.trainer.pipeline.balance import Host, UnitCosts, fastest, min_max_partition
from pipejob.trainer.pipeline.counted_cost import (
    FLOPS_PER_BYTE,
    MICRO_BATCH_OVERHEAD,
    count_chain,
)
from pipejob.trainer.pipeline.eager.placement import describe, no_grad_run, place
from pipejob.trainer.pipeline.micro_batch_choice import candidate, prediction

WIDTHS = [(16, 64), (64, 256), (256, 64), (64, 8)]  # Linear layers, a ReLU after each but the last


def pieces() -> tuple[list[nn.Module], list[str]]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for k, (a, b) in enumerate(WIDTHS):
        layers.append(nn.Linear(a, b))
        if k < len(WIDTHS) - 1:
            layers.append(nn.ReLU())
    return layers, [f"layer{i}" for i in range(len(layers))]


def test_counted_costs_are_the_same_every_time_and_count_flops_and_bytes():
    layers, names = pieces()
    sample = torch.randn(8, 16)
    first, passed = count_chain(layers, names, (sample,), True)
    second, _ = count_chain(layers, names, (sample,), True)
    assert first == second and first.counted
    assert passed[0].shape == (8, 8) and not passed[0].requires_grad
    # The first Linear: forward 2*B*in*out FLOPs, its weight's gradient as many (the data
    # needs none), and its input and output moved twice (forward, then their gradients).
    b, (i, o) = 8, WIDTHS[0]
    assert first.seconds[0] == 2 * (2 * b * i * o) + FLOPS_PER_BYTE * 2 * 4 * (b * i + b * o)
    # A later Linear computes its input's gradient too: three matmuls.
    i, o = WIDTHS[1]
    assert first.seconds[2] == 3 * (2 * b * i * o) + FLOPS_PER_BYTE * 2 * 4 * (b * i + b * o)
    # A ReLU has no FLOPs to count, but what it moves is not free.
    assert first.seconds[1] == FLOPS_PER_BYTE * 2 * 4 * (2 * b * 64)
    assert all(p.grad is None for layer in layers for p in layer.parameters())  # on copies


def test_the_counted_split_puts_the_wide_layers_apart():
    layers, names = pieces()
    costs, _ = count_chain(layers, names, (torch.randn(8, 16),), True)
    # The two wide matmuls (64->256, 256->64) on stages of their own, the wide ReLU between
    # them alone: its 16 KiB moved each way weigh more than nothing.
    assert min_max_partition(costs.seconds, 3) == [range(0, 3), range(3, 4), range(4, 7)]


class Slow(nn.Module):
    """A Linear whose forward also waits (a Python loop, a busy machine): time it costs that
    no count sees."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return self.linear(x)


class FourLayers(nn.Module):
    """Four equal Linear layers, the first slow; the forward passes one a keyword argument,
    as ESM's glue does."""

    def __init__(self) -> None:
        super().__init__()
        self.slow, self.a, self.b, self.c = Slow(), nn.Linear(64, 64), nn.Linear(64, 64), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(self.slow(x))), scale=2.0)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.linear(x) * scale


def test_the_eager_path_places_by_counted_cost_alike_every_time():
    """spec.deterministic on the eager path: each module's forward + backward FLOPs and bytes
    moved, as the traced cut counts a piece, so two placements are the same, whatever the
    machine's load; timed, the slow module would sit alone on the first stage."""
    torch.manual_seed(0)
    model = FourLayers()
    run = no_grad_run(model, torch.randn(8, 64))
    first, second = (place(model, run, 2, counted=True) for _ in range(2))
    assert first.counted and first.stages == [["slow", "a"], ["b", "c"]]
    assert (first.stages, first.costs) == (second.stages, second.costs)
    timed = place(model, run, 2)
    assert not timed.counted and timed.stages == [["slow"], ["a", "b", "c"]]
    b = 8  # each Linear (a, its input's gradient needed): three matmuls; in and out, twice
    linear = 3 * (2 * b * 64 * 64) + FLOPS_PER_BYTE * 2 * 4 * (b * 64 + b * 64)
    assert first.costs == dict.fromkeys(["slow", "a", "b", "c"], linear)  # c's keyword too
    assert describe(first)[0] == "stage 0: slow, a (50% of counted cost)"
    assert all(p.grad is None for p in model.parameters())  # counted on copies


# ResNet-50's counted cost per 64x64 image on each of 2 stages at its counted cut (forward +
# backward FLOPs and bytes, as the example's run counts them), and two models far lighter and
# heavier: auto's choice under spec.deterministic from their counts alone.
RESNET50_PER_IMAGE = [1.087e9, 0.939e9]


def counted_choice(per_sample: list[float], hosts: list[Host], batch: int = 32) -> int:
    """The count `microBatches: auto` runs under spec.deterministic, as cut_model._measure
    chooses it: each candidate's costs counted at its micro-batch size (linear in it, as
    FLOPs and bytes are), predicted, the fastest."""
    predictions = []
    for m in auto_counts(batch, "1f1b", 2):
        counted = [c * (batch // m) for c in per_sample]
        costs = UnitCosts(counted, list(counted), counted=True)
        predictions.append(prediction(costs, 2, m, batch, hosts))
    return fastest(predictions).micro_batches


def test_auto_under_deterministic_chooses_by_counted_cost_alike_on_every_machine():
    """The count comes from the counts, a fixed overhead per micro-batch and the schedule's
    slots, never from the cores the stages share: the same on a 2-core laptop as on 64 cores
    (timed, the cores bound moves the choice)."""
    laptop, server = [Host((0, 1), 2.0)], [Host((0,), 32.0), Host((1,), 32.0)]
    for hosts in ([], laptop, server):
        assert counted_choice(RESNET50_PER_IMAGE, hosts) == 4
        assert counted_choice([1e6, 1e6], hosts) == 2  # overhead dominates: 1f1b's fewest
        assert counted_choice([1e12, 1e12], hosts) == 16  # work dominates: the least bubble
    # The prediction: (m + stages - 1) slots, each the slowest stage's count per micro-batch
    # plus the fixed overhead.
    costs = UnitCosts([8 * c for c in RESNET50_PER_IMAGE], [0.0, 0.0], counted=True)
    p = prediction(costs, 2, 4, 32, laptop)
    assert p.counted and p.step_seconds == 5 * (8 * 1.087e9 + MICRO_BATCH_OVERHEAD)
    assert candidate(p) == {
        "microBatches": 4,
        "microBatchSize": 8,
        "predictedStepCount": p.step_seconds,
    }


def test_auto_micro_batches_are_accepted_with_deterministic_and_plan_says_counted():
    job = spec.parse(pipeline_job("j", microBatches="auto", deterministic=True))
    lines = job.definition.describe(job.settings)
    assert any(line.startswith("microBatches auto: chosen by counted cost") for line in lines)
    timed = spec.parse(pipeline_job("j", microBatches="auto"))
    assert not any("counted" in line for line in timed.definition.describe(timed.settings))


def test_plan_says_the_cut_is_counted():
    for deterministic in (True, False):
        job = spec.parse(pipeline_job("j", deterministic=deterministic))
        lines = job.definition.describe(job.settings)
        counted = any(line.startswith("cut: counted (spec.deterministic)") for line in lines)
        assert counted == deterministic


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> dict[str, str]:
    train = tmp_path_factory.mktemp("stdlib-bytes") / "train.bin"
    write_stdlib_tokens(train, max_bytes=100_000)  # as test_determinism's lm_job reads
    return {"train": str(train)}


# slow: two worlds of 4 processes; the in-process tests above hold the counts and the split
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_runs_without_split_points_cut_alike_and_write_the_same_bits(text, tmp_path):
    job = lm_job(text, stages=3, engine="pipelining", schedule="1f1b", deterministic=True)
    del job["spec"]["splitPoints"]  # lm_job pins a cut; this test is of the cut counted
    assert_same_bits(job, tmp_path, timeout=300)
    for run in ("a", "b"):  # where assert_same_bits runs them; jobrun names the summary
        summary = json.loads(next((tmp_path / run).glob("*.summary.json")).read_text())
        assert summary["cutBy"] == "counted"


class Gated(nn.Module):
    """A module that runs only while the glue lets it (a flag set just before its call)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.open = nn.Linear(4, 4), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.open:
            raise RuntimeError("called outside the glue's window")
        return self.linear(x)


class OpensTheGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.out = Gated(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gate.open = True
        y = self.gate(x)
        self.gate.open = False
        return self.out(y)


def test_a_module_that_cannot_be_counted_again_is_named_with_the_way_out():
    model = OpensTheGate()
    run = no_grad_run(model, torch.randn(2, 4))
    place(model, run, 2)  # timed, it places
    with pytest.raises(
        ValueError,
        match=r"spec.deterministic: gate cannot be counted .*"
        r"RuntimeError: called outside .* leave spec.deterministic out",
    ):
        place(model, run, 2, counted=True)


# slow: two worlds of 3 processes; the in-process tests above hold the choice and its model
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_counted_auto_count_is_logged_and_kept_on_resume(tmp_path):
    """microBatches auto under spec.deterministic: the choice said with its counts, kept in
    the summary and the checkpoint, and a resumed run runs it again without counting."""
    job = pipeline_job(
        "auto",
        stages=2,
        microBatches="auto",
        deterministic=True,
        steps=2,
        logEvery=2,
        checkpoint={"path": str(tmp_path / "checkpoints"), "everySteps": 1},
        preflight={"megabytes": 0.5},
    )
    code, out, summary = run_to_end(job, tmp_path, timeout=150)
    assert code == 0 and summary is not None, out
    m, candidates = summary["microBatches"], summary["microBatchCandidates"]
    counts = [c["microBatches"] for c in candidates]
    assert counts == [2, 4]  # batch 8: micro-batches >= 2, and 1F1B's at least 2 stages
    assert m == min(candidates, key=lambda c: c["predictedStepCount"])["microBatches"]
    assert f"microBatches auto chose {m} (micro-batches of {8 // m}) by counted cost" in out
    assert re.search(rf"^master\s*\|\s+{m}\s+{8 // m}\s+[\d.]+  <- chosen$", out, re.M)
    assert f"microBatches auto chose {m} of 2, 4 by counted cost (predicted" in out

    longer = pipeline_job("auto", **(job["spec"] | {"steps": 3}))
    code, out, summary = run_to_end(longer, tmp_path, timeout=150)
    assert code == 0 and summary is not None, out
    assert "resumed from step 2" in out and "count what each part costs" not in out
    assert f"microBatches auto resumes with the checkpoint's {m} (micro-batches of" in out
    assert summary["microBatches"] == m and summary["microBatchCandidates"] == candidates
