"""PipelineJob trainer: real RPC worlds on loopback, and the pure pieces they are built from."""

from __future__ import annotations

import itertools
import math
import re
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

from jobrun import check_gradients, pipeline_job, run_to_end
from pipejob.core import spec
from pipejob.core.common_spec import Optimizer, from_spec
from pipejob.trainer.pipeline.rpc.stage import RpcStage, stage_devices
from pipejob.trainer.pipeline.rpc.turnstile import Turnstile
from pipejob.trainer.pipeline.run_json import Candidate, PipelineSummary, StageRow
from pipejob.trainer.pipeline.summary import gpipe_bubble
from pipejob.trainer.pipeline.timing import busy_seconds, step_seconds
from pipejob.trainer.runtime.optim import optimizer_args
from pipejob.trainer.workloads import cut, models
from pipejob.trainer.workloads.synthetic import SyntheticImages


def assert_keys(value: dict[str, Any], shape: Any) -> None:
    """`value` holds every key the TypedDict `shape` requires and none it does not declare."""
    keys, declared = set(value), shape.__required_keys__ | shape.__optional_keys__
    assert shape.__required_keys__ <= keys, f"missing: {shape.__required_keys__ - keys}"
    assert keys <= declared, f"not in {shape.__name__}: {keys - declared}"


def check_summary(summary: dict[str, Any], job: dict[str, Any]) -> None:
    s = job["spec"]
    # The summary JSON is the format pipeline/run_json.py declares, rows and candidates too.
    assert_keys(summary, PipelineSummary)
    for row in [*summary["partition"], *summary["microBatchCandidates"]]:
        assert_keys(row, StageRow if "stage" in row else Candidate)
    assert summary["kind"] == "PipelineJob"
    assert summary["steps"] == s["steps"] == len(summary["losses"])
    assert all(math.isfinite(loss) for loss in summary["losses"])
    assert math.isfinite(summary["finalLoss"])
    assert summary["samplesPerSecond"] > 0
    # The stages hold the whole cut model, in order, each a non-empty run of its units.
    model = models.build(spec.parse(job).settings)
    names = cut.Traced(model).units
    stages = summary["partition"]
    assert [st["stage"] for st in stages] == [f"stage{i}" for i in range(s["stages"])]
    assert [n for st in stages for n in st["layers"]] == names
    assert all(st["layers"] for st in stages)
    assert sum(st["costShare"] for st in stages) == pytest.approx(1, abs=1e-3)
    for st in stages:
        assert st["forwardSeconds"] > 0 and st["backwardSeconds"] > 0, st
        assert 0 <= st["idleFraction"] < 1, st
    p, m = s["stages"], summary["microBatches"]
    assert summary["microBatchesRequested"] == s["microBatches"]
    if s["microBatches"] != "auto":
        assert m == s["microBatches"] and summary["microBatchCandidates"] == []
    assert summary["bubble"]["gpipeIdeal"] == pytest.approx((p - 1) / (m + p - 1), abs=1e-4)
    assert 0 < summary["bubble"]["measured"] < 1
    # Every process's peak memory (runtime/memory.py): a stage's is above the bytes of its
    # own parameters (it holds them, and torch), and nothing here comes near 20 GB.
    memory = summary["memory"]
    assert {"master", *(st["stage"] for st in stages)} <= set(memory), memory
    assert all(50e6 < m["rssPeakBytes"] < 20e9 for m in memory.values()), memory
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    for st in stages:
        own = sum(
            b
            for n, b in sizes.items()
            if any(n == u or n.startswith(u + ".") for u in st["layers"])
        )
        assert st["peakMemory"] == memory[st["stage"]]
        assert own < st["peakMemory"]["rssPeakBytes"], (own, st)


# ------------------------------------------------------------------ real training worlds


@pytest.mark.slow  # the gradients' test below runs a 2-stage world
@pytest.mark.timeout(200)
def test_two_stage_pipeline_trains(tmp_path):
    job = pipeline_job(
        "two-stages",
        stages=2,
        microBatches=2,
        steps=3,
        optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.9},
    )
    code, out, summary = run_to_end(job, tmp_path, timeout=180)
    assert code == 0, out
    for step in (1, 2, 3):
        assert f"step {step}/3  loss " in out
    # engine auto takes the pipelining engine here, with its 1f1b schedule (same ideal bubble)
    assert "summary:" in out and "1f1b ideal (p-1)/(m+p-1)" in out
    assert re.search(r"peak memory besides the stages above: master \d+ MB$", out, re.M), out
    check_summary(summary, job)


@pytest.mark.slow  # the 3-stage language model's step is exact; the gradients' test below
@pytest.mark.timeout(200)
def test_three_stage_pipeline_trains(tmp_path):
    # More micro-batches than a stage has RPC threads (16): waiting for inputs must not
    # take them all.
    job = pipeline_job(
        "three-stages",
        stages=3,
        batchSize=40,
        microBatches=20,
        steps=2,
        logEvery=2,
        optimizer={"name": "adam", "lr": 0.001, "weightDecay": 0.01},
    )
    code, out, summary = run_to_end(job, tmp_path, timeout=180)
    assert code == 0, out
    assert "step 2/2  loss " in out and "step 1/2" not in out  # logEvery
    assert "started stage2" in out
    check_summary(summary, job)


# slow: two worlds: test_auto_ranking.py holds the choice, test_checkpoint.py the resume
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_auto_micro_batches_are_chosen_once_and_kept_on_resume(tmp_path):
    """microBatches auto measures every candidate count, runs the one with the shortest
    predicted step and keeps it in the checkpoint: a resumed run uses it again, and a resume
    with another explicit count runs with that count."""
    job = pipeline_job(
        "auto",
        stages=2,
        microBatches="auto",
        steps=2,
        logEvery=2,
        checkpoint={"path": str(tmp_path / "checkpoints"), "everySteps": 1},
        preflight={"megabytes": 0.5},
    )
    code, out, summary = run_to_end(job, tmp_path, timeout=150)
    assert code == 0, out
    check_summary(summary, job)
    candidates = summary["microBatchCandidates"]
    # batch 8: micro-batches >= 2; engine auto runs 1F1B, which needs at least 2 (the stages)
    assert [c["microBatches"] for c in candidates] == [2, 4]
    assert [c["microBatchSize"] for c in candidates] == [4, 2]
    best = min(candidates, key=lambda c: c["predictedStepSeconds"])
    m = summary["microBatches"]
    assert m == best["microBatches"]
    for c in candidates:
        assert c["predictedStepSeconds"] == max(c["pipelineBoundSeconds"], c["coresBoundSeconds"])
        assert c["predictedSamplesPerSecond"] == pytest.approx(
            8 / c["predictedStepSeconds"], rel=1e-2
        )
    assert f"microBatches auto chose {m} (micro-batches of {8 // m}):" in out
    # m, micro-batch size, the two bounds, the prediction and its samples/s.
    assert re.search(rf"^master\s*\|\s+{m}\s+{8 // m}(\s+[\d.]+){{4}}  <- chosen$", out, re.M)
    assert f"microBatches auto chose {m} of 2, 4: predicted" in out  # in the summary

    longer = pipeline_job("auto", **(job["spec"] | {"steps": 3}))
    code, out, summary = run_to_end(longer, tmp_path, timeout=150)
    assert code == 0, out
    assert "resumed from step 2" in out and "measuring what each part costs" not in out
    assert f"microBatches auto resumes with the checkpoint's {m} (micro-batches of" in out
    assert summary["microBatches"] == m and summary["microBatchCandidates"] == candidates

    # Another explicit count resumes the checkpoint with that count (checkpoints reshard).
    other = 1 if m != 1 else 2
    resized = pipeline_job("auto", **(job["spec"] | {"microBatches": other, "steps": 4}))
    code, out, summary = run_to_end(resized, tmp_path, timeout=150)
    assert code == 0, out
    assert "resumed from step 3" in out and summary["microBatches"] == other, out


@pytest.mark.timeout(200)
def test_pipeline_gradients_equal_single_process_gradients(tmp_path):
    # the rpc engine's (tests/test_pipelining.py: the pipelining engine's, every schedule)
    job = spec.parse(pipeline_job("gradients", engine="rpc", stages=3, microBatches=4, steps=1))
    got = check_gradients(job, tmp_path)
    assert [n for stage in got["stages"] for n in stage] == cut.Traced(
        models.build(job.settings)
    ).units


# ------------------------------------------------------------------ pure pieces


def test_stage_devices_map_neighbours_gpu_to_gpu():
    names = ["stage0", "stage1", "stage2"]
    assert stage_devices(1, names, gpus=0) == (None, None)
    assert stage_devices(0, names, gpus=1) == ({"stage1": {0: 0}}, [0])
    assert stage_devices(1, names, gpus=1) == (
        {"stage0": {0: 0}, "stage2": {0: 0}},
        [0],
    )
    assert stage_devices(2, names, gpus=2) == ({"stage1": {0: 0}}, [0])


def test_busy_seconds_is_the_union_of_intervals():
    assert busy_seconds([]) == 0
    assert busy_seconds([(0, 1), (2, 3)]) == 2
    assert busy_seconds([(0, 2), (1, 3), (1.5, 2.5)]) == 3
    assert busy_seconds([(5, 6), (0, 10)]) == 10


def test_step_seconds_counts_overlapping_backwards_once():
    events = [
        {"forward": [0, 1], "backward": [4, 7]},
        {"forward": [1, 2], "backward": [5, 8]},
    ]
    assert step_seconds(events) == (2, 4, 6)


def test_gpipe_bubble():
    assert gpipe_bubble(2, 1) == 0.5
    assert gpipe_bubble(2, 4) == pytest.approx(0.2)
    assert gpipe_bubble(4, 8) == pytest.approx(3 / 11)


@pytest.mark.parametrize(
    "opt, cls, kwargs",
    [
        (
            {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weightDecay": 0.0},
            torch.optim.SGD,
            {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0},
        ),
        (
            {"name": "rmsprop", "lr": 0.1, "momentum": 0.5, "weightDecay": 0.1},
            torch.optim.RMSprop,
            {"lr": 0.1, "momentum": 0.5, "weight_decay": 0.1},
        ),
        (
            {"name": "adam", "lr": 0.01, "momentum": 0.0, "weightDecay": 0.0},
            torch.optim.Adam,
            {"lr": 0.01, "weight_decay": 0.0, "betas": (0.9, 0.999)},
        ),
        (
            {"name": "adamw", "lr": 0.01, "momentum": 0.0, "weightDecay": 0.1, "beta2": 0.95},
            torch.optim.AdamW,
            {"lr": 0.01, "weight_decay": 0.1, "betas": (0.9, 0.95)},
        ),
    ],
)
def test_optimizer_args(opt, cls, kwargs):
    assert optimizer_args(from_spec(Optimizer, opt)) == (cls, kwargs)


def test_synthetic_images_are_seeded_and_coloured_by_class():
    a, b = SyntheticImages(3, 64, 32, 4), SyntheticImages(3, 64, 32, 4)
    (xa, ya), (xb, yb) = a.batch(), b.batch()
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.batch()[0], xa)  # a new batch each step
    assert xa.shape == (64, 3, 32, 32) and ya.shape == (64,)
    # The class is in the colour: each image's mean colour is close to its class's colour.
    means = xa.mean(dim=(2, 3))
    nearest = torch.cdist(means, a.colours.flatten(1)).argmin(dim=1)
    assert (nearest == ya).float().mean() > 0.9


def test_stage_times_forward_and_backward_of_each_micro_batch():
    """The stage's timing hooks, in one process: a stage in the middle of a pipeline (its
    input comes with a gradient function) and one at the start (a plain input)."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    for middle in (True, False):
        stage = RpcStage(layers, last=False, device="cpu")
        for step in range(2):
            for mb in range(2):
                x = torch.randn(4, 8, requires_grad=middle)
                y = stage.forward((x * 2 if middle else x,), step, mb, step)
                start = time.perf_counter()
                y.sum().backward()
                end = time.perf_counter()
                # Backward happened within this window, and was recorded in it.
                # Keyed by step, then (round, micro-batch): here each step is one round.
                (key, events), *_ = [
                    (k, v) for k, v in stage.times._events.items() if k == (step, (step, mb))
                ]
                (times,) = stage.times._intervals([events])
                b0, b1 = times["backward"]
                assert start <= b0 <= b1 <= end
        times = stage.timings()
        assert sorted(times) == [0, 1]
        for forward, backward, busy in times.values():
            assert forward > 0 and backward > 0
            assert busy == pytest.approx(forward + backward)  # no overlap when sequential


# ------------------------------------------------------------------ forwards in order


def _arrive(turnstile: Turnstile, step: int, index: int, passed: list, fail=False):
    with turnstile.turn(step, index):
        passed.append((step, index))
        if fail:
            raise RuntimeError(f"micro-batch {index} failed")


def _start(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _wait_until_blocked(threads: list[threading.Thread], passed: list, expected: int) -> None:
    """Let the threads reach the turnstile: none of them can pass it yet."""
    for _ in range(20):
        time.sleep(0.01)
        assert len(passed) == expected and all(t.is_alive() for t in threads)


@pytest.mark.timeout(30)
def test_turnstile_lets_micro_batches_through_in_order():
    turnstile, passed = Turnstile(timeout=20), []
    # Micro-batches 3, 2 and 1 arrive first and wait (a lock would let 3 in first).
    early = [_start(_arrive, turnstile, 0, i, passed) for i in (3, 2, 1)]
    _wait_until_blocked(early, passed, 0)
    _start(_arrive, turnstile, 0, 0, passed).join(20)
    for t in early:
        t.join(20)
    # The next step (its forwards start once the last step's have ended) starts at 0 again.
    for t in [_start(_arrive, turnstile, 1, i, passed) for i in (1, 0)]:
        t.join(20)
    assert passed == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]


@pytest.mark.timeout(30)
def test_a_failed_micro_batch_passes_its_turn_on():
    turnstile, passed, errors = Turnstile(timeout=20), [], []

    def failing():
        try:
            _arrive(turnstile, 0, 0, passed, fail=True)
        except RuntimeError as e:
            errors.append(str(e))

    waiting = [_start(_arrive, turnstile, 0, 1, passed)]
    _wait_until_blocked(waiting, passed, 0)
    _start(failing).join(20)
    waiting[0].join(20)
    assert errors == ["micro-batch 0 failed"] and passed == [(0, 0), (0, 1)]


def test_a_turn_that_never_comes_is_an_error_not_a_hang():
    turnstile = Turnstile(timeout=0.2)
    with pytest.raises(TimeoutError, match=r"micro-batch 2 of step 0 waited 0.2s for its turn"):
        with turnstile.turn(0, 2):
            pass
    with turnstile.turn(0, 0):  # the error left the turnstile as it was
        pass


@pytest.mark.timeout(60)
def test_stage_runs_forwards_in_micro_batch_order_whatever_their_arrival():
    """Forwards reach a stage's RPC threads out of order; it computes them in order."""
    torch.manual_seed(0)
    stage = RpcStage(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), last=True, device="cpu")
    done: list[int] = []

    def call(mb: int) -> None:
        stage.forward((torch.randn(4, 8),), 0, mb, 0)
        done.append(mb)

    threads = [_start(call, mb) for mb in (3, 1, 2)]
    _wait_until_blocked(threads, done, 0)
    threads.append(_start(call, 0))
    for t in threads:
        t.join(30)
    assert sorted(done) == [0, 1, 2, 3]
    # One at a time, in order: each forward ended before the next one started.
    intervals = [stage.times._events[0, (0, mb)]["forward"] for mb in range(4)]  # step 0, round 0
    for (_, end), (start, _) in itertools.pairwise(intervals):
        assert end <= start, intervals


@pytest.mark.timeout(30)
def test_settle_returns_once_every_micro_batch_has_backpropagated():
    """The master settles each stage before the optimizer steps: a stage in the middle of a
    pipeline (inputs with a gradient function, as received from the previous stage) counts a
    micro-batch once its gradient has gone back through every unit of its pieces."""
    stage = RpcStage(
        nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)), last=False, device="cpu"
    )
    outputs = [
        stage.forward((torch.randn(4, 8, requires_grad=True) * 2,), 0, mb, 0) for mb in range(2)
    ]
    settled = threading.Event()
    waiter = _start(lambda: (stage.settle(0, 2), settled.set()))
    outputs[0].sum().backward()
    assert not settled.wait(0.3)  # one of two micro-batches: not yet
    outputs[1].sum().backward()
    assert settled.wait(10)
    waiter.join(10)
