"""What the benchmarks print, computed from results made up here: the fits and tables the
device call's reader relies on, checked in process in `make test` (the scripts' runs are
the slow rehearsals: tests/test_benchmarks.py, tests/test_device.py)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark(name: str) -> ModuleType:
    """A script of benchmarks/ loaded as a module (its main is not run)."""
    found = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def registered_benchmark(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """A script of benchmarks/ as a module importing its helpers beside it, in sys.modules while
    the test runs (its dataclasses look their module up there)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    found = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    monkeypatch.setitem(sys.modules, name, module)
    found.loader.exec_module(module)
    return module


def test_overhead_fits_a_step_as_fixed_plus_per_micro_batch_and_reports_both_parts():
    """overhead.py's fit and tables (its run is the device rehearsal's: tests/test_device.py)."""
    overhead = benchmark("overhead")
    fixed, per, residual = overhead.fit([(1, 0.012), (2, 0.014), (4, 0.018), (8, 0.026)])
    assert (fixed, per, residual) == pytest.approx((0.010, 0.002, 0.0), abs=1e-12)
    results = [
        {"stages": 2, "model": "tiny", "m": m, "system": system, "seconds": s, "least": s}
        for system, (a, b) in {"rpc": (0.004, 0.002), "torch-1f1b": (0.002, 0.001)}.items()
        for m in (2, 4)
        for s in [a + b * m]
    ]
    rows = overhead.table(results, "least").splitlines()
    assert re.search(
        r"^\s+2\s+tiny\s+rpc\s+4\.00\s+2\.000\s+0\.00\s+2\.00x\s+2\.00x\s+2,4$", rows[1]
    ), rows
    assert re.search(r"^\s+2\s+tiny\s+torch-1f1b\s+2\.00\s+1\.000\s+0\.00\s+2,4$", rows[2]), rows
    # Paired turn by turn with torch's same schedule: the median gap of the turns (one turn
    # disturbed by 50 ms), fitted as 2 ms a step plus 1 ms a micro-batch.
    turns = {
        "torch-gpipe": lambda m: [0.010 * m, 0.011 * m, 0.009 * m],
        "rpc": lambda m: [
            0.010 * m + 0.002 + 0.001 * m,
            0.011 * m + 0.052,
            0.009 * m + 0.002 + 0.001 * m,
        ],
    }
    paired = [
        {"stages": 4, "model": "tiny", "m": m, "system": system, "turns": each(m)}
        for system, each in turns.items()
        for m in (1, 2, 8)
    ]
    # The profiled step at one micro-batch shares a timed result's key and has no turns.
    profiled = {"stages": 4, "model": "tiny", "m": 1, "system": "rpc", "phases": {}, "span": 0.1}
    rows = overhead.gaps([*paired, profiled], "turns").splitlines()
    assert len(rows) == 2, rows
    assert re.search(
        r"^\s+4\s+tiny\s+rpc\s+torch-gpipe\s+2\.00\s+1\.000\s+0\.00  1:\+3\.0 2:\+4\.0 8:\+10\.0$",
        rows[1],
    ), rows
    # Issue 61's line on the default engine's GPipe: 0.5 ms a step over torch's and nothing
    # per micro-batch meets it (by the turns' medians; their least steps miss it), with
    # the load the counts ran at.
    line = [
        {"stages": 2, "model": "tiny", "m": m, "system": system, "load": [1.5, 2.5]}
        | {"turns": [t + extra * 0.0005], "turns_least": [t + extra * 0.002]}
        for m in (1, 2, 4)
        for system, extra in (("gpipe", 1), ("torch-gpipe", 0))
        for t in [0.01 * m]
    ]
    assert overhead.verdict(line) == (
        "  2 stages tiny gpipe: median +0.50 ms + +0.000 ms/mb (met);"
        " least +2.00 ms + +0.000 ms/mb (missed); load 1.5-2.5"
    )


@pytest.fixture
def repeat_runs(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """repeat_runs.py as a module, importing _common beside it."""
    return registered_benchmark(monkeypatch, "repeat_runs")


def test_repeat_runs_names_the_first_place_two_runs_differ(repeat_runs, tmp_path: Path):
    """What repeat_runs.py compares, and what it leaves out as the clock's (its run is the
    slow rehearsal: tests/test_benchmarks.py)."""
    step = "master | step {}/3  loss {}  9.1 samples/s  lr 0.001  grad norm 0.5"
    files = {"out/model.safetensors": b"weights", "out/model.json": b"{}"}

    def run(losses=(2.5, 2.25, 2.0), wrote=None, lines=None):
        summary = {"losses": list(losses), "gradNorms": [0.5, 0.5, 0.5]}
        lines = lines or [step.format(k + 1, f"{x:.4f}") for k, x in enumerate(losses)]
        return repeat_runs.Run(0, lines, summary, wrote or files, 1.0)

    folders = (tmp_path / "a", tmp_path / "b")
    differ = repeat_runs.first_difference
    assert differ(run(), run(), folders) is None
    assert differ(run(), run(losses=(2.5, 2.25, 2.0000002)), folders) == (
        "summary losses[2]: [2.0] / [2.0000002]"
    )
    late = [step.format(1, "2.5000"), step.format(3, "2.0000")]
    assert differ(run(), run(lines=late), folders) == ("step line 2: ('2.2500', '0.5') / None")
    assert differ(run(), run(wrote={**files, "out/model.json": b"{ }"}), folders) == (
        "out/model.json: bytes differ"
    )
    assert differ(run(), run(wrote={"out/model.json": b"{}"}), folders) == (
        "out/model.safetensors: written by run a only"
    )
    # A checkpoint's manifest says when it was written: only that may differ.
    at = "ckpt/step-00000003/manifest.json"
    first = {**files, at: b'{"step": 3, "time": 1.5, "costs": [0.25]}'}
    assert (
        differ(
            run(wrote=first),
            run(wrote={**first, at: b'{"time": 2.5, "step": 3, "costs": [0.5]}'}),
            folders,
        )
        is None
    )
    assert differ(run(wrote=first), run(wrote={**first, at: b'{"step": 2, "time": 1.5}'}), folders)


def test_repeat_runs_compares_tensorboard_by_its_scalars_not_its_clock(repeat_runs, tmp_path):
    from tensorboardX import SummaryWriter

    def events(folder: Path, loss: float, rate: float) -> dict[str, bytes]:
        with SummaryWriter(str(folder / "runs")) as w:
            for k in (1, 2):
                w.add_scalar("train/loss", loss / k, k)
                w.add_scalar("train/samples_per_second", rate, k)
        return {str(p.relative_to(folder)): p.read_bytes() for p in (folder / "runs").iterdir()}

    a, b, c = (tmp_path / n for n in "abc")
    runs = [
        repeat_runs.Run(0, [], {"losses": [1.0]}, events(folder, loss, rate), 1.0)
        for folder, loss, rate in ((a, 2.0, 90.0), (b, 2.0, 95.0), (c, 2.5, 90.0))
    ]
    # Each event carries its wall time, and the file's name the host and the time.
    assert list(runs[0].files.values()) != list(runs[1].files.values())
    assert repeat_runs.first_difference(runs[0], runs[1], (a, b)) is None
    assert repeat_runs.first_difference(runs[0], runs[2], (a, c)) == (
        "runs: TensorBoard's train/loss differs"
    )


def test_repeat_runs_overrides_only_what_an_example_needs_to_run_here(repeat_runs):
    import argparse

    args = argparse.Namespace(steps={"*": 4}, engines=["rpc", "pipelining"], replicas=0, set=[])
    by_example = {e: repeat_runs.cases(e, args) for e in repeat_runs.discover([])}
    kueue = by_example["kueue-pipeline.yaml"][0]
    assert kueue.skip is None  # what it runs still parses
    assert kueue.overrides == [
        "steps 100->4",
        "checkpoint.everySteps 10->4",
        "checkpoint.path /checkpoints->checkpoints",
        "checkpoint.volume dropped",
        "engine auto->rpc",
    ]
    lm = by_example["transformer-lm/pipelinejob.yaml"]
    assert [c.skip for c in lm] == [None, None] and "warmupSteps 20->2" in lm[0].overrides
    rpc, pipelining = by_example["resnet50-pipelining.yaml"]
    assert "schedule 1f1b dropped (rpc runs gpipe)" in rpc.overrides and rpc.skip is None
    assert pipelining.overrides == ["steps 100->4"]
    for gpu in ("resnet50-pipeline-gpu.yaml", "hybrid-gpu.yaml"):
        assert "a GPU job" in by_example[gpu][0].skip
    assert "/data/criteo" in by_example["dlrm/days.yaml"][0].skip
    assert [len(by_example[e]) for e in ("hybrid.yaml", "dlrm/hybridjob.yaml")] == [1, 1]
    # Issue 57's digits case (benchmarks/repeat/) runs beside the examples, on both engines.
    assert [c.skip for c in by_example["digits/pipelinejob.yaml"]] == [None, None]
    assert repeat_runs.discover(["digits"]) == ["digits/pipelinejob.yaml"]


def test_compare_reports_each_variant_against_its_system_and_per_cpu_against_torch(monkeypatch):
    """compare.py's report: a variant of the default engine's system (pipejob-1f1b:t2) beside
    the system, and each pipejob system's samples per CPU-second over torch's best schedule
    (issue 61's line), each system at its best count."""
    compare = registered_benchmark(monkeypatch, "compare")
    Counters = sys.modules["_common"].Counters

    def run(system: str, rate: float, cpu: float) -> object:
        # 48 samples a batch, 4 batches: 192 samples over `cpu` CPU-seconds in all.
        processes = {"stage0": Counters(cpu / 2), "stage1": Counters(cpu / 2)}
        return compare.Run(system, 2, rate, "load 1", 4.0, 4, processes)

    runs = [
        run("pipejob-1f1b", 60.0, 3.84),  # 50 samples per CPU-second
        run("pipejob-1f1b:t2", 64.0, 4.8),  # 40
        run("gpipe", 55.0, 4.0),  # 48
        run("1f1b", 58.0, 4.8),  # 40
    ]
    text = compare.report(runs, 2)
    assert re.search(r"pipejob-1f1b / pipejob-1f1b:t2 \(a lever's gain\)\s+0\.94x", text), text
    assert "per CPU-second, over torch's best (gpipe, 48.0):" in text, text
    assert re.search(r"^    pipejob-1f1b\s+1\.04x$", text, re.M), text
    assert re.search(r"^    pipejob-1f1b:t2\s+0\.83x$", text, re.M), text


def test_torch_s_loop_as_a_user_runs_it_reads_each_step_from_a_dataloader(monkeypatch):
    """overhead.py's torch-gpipe-loader: the first stage takes each step's inputs and the last
    its target from a DataLoader of its own, batch after batch, starting over at the end;
    torch-gpipe's loop takes one fixed batch every step."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import torch

    bench = benchmark("_overhead")
    first, last = (SimpleNamespace(first=f, last=not f) for f in (True, False))
    fixed = bench._batches(first, (2, 4), 16, loader=False)
    assert next(fixed)[0][0] is next(fixed)[0][0] and next(fixed)[1] is None
    read = [next(bench._batches(last, (2, 4), 16, loader=True))]
    targets = bench._batches(last, (2, 4), 16, loader=True)
    steps = [next(targets) for _ in range(bench.BATCHES + 1)]
    assert all(args == () and target.shape == (2, 4) for args, target in steps)
    assert not torch.equal(steps[0][1], steps[1][1])  # the next batch each step
    assert torch.equal(steps[0][1], steps[-1][1]) and torch.equal(steps[0][1], read[0][1])
    inputs = next(bench._batches(first, (2, 4), 16, loader=True))
    assert inputs[1] is None and inputs[0][0].shape == (2, 4)
