"""The GPU machine's proof, rehearsed: `benchmarks/device.sh --cpu` runs every step of the
GPU run small on this machine's CPUs (issue 36), so the script works the first time there.
Each step must pass and leave what the GPU run's reader looks for in its log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HANG = 900  # a bound on a hang: the rehearsal takes about 3 minutes on 2 quiet cores


# Run before each device call (`pytest -m slow tests/test_device.py`, or `make test-all`), not
# in `make test`: it is the GPU script's rehearsal, not a proof of the product (tests/README.md).
@pytest.mark.slow
@pytest.mark.timeout(HANG + 60)
def test_the_device_script_rehearses_every_step_on_the_cpu(tmp_path: Path):
    out = tmp_path / "results"
    done = subprocess.run(
        [str(ROOT / "benchmarks" / "device.sh"), "--cpu", "--out", str(out), "--budget", "840"],
        capture_output=True,
        text=True,
        timeout=HANG,
        env=os.environ | {"PYTHON": sys.executable, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    steps = (
        "machine",
        "install",
        "gpu-tests",
        "gpu-bench",
        "hybrid",
        "transfer",
        "profile",
        "overhead",
    )
    for step in (*steps, "cores"):
        assert re.search(rf"^  {step}: ok \(\d+s\)$", summary, re.M), summary
    assert "cores-levers" not in summary  # only when asked for
    with tarfile.open(out / "logs.tar.gz") as logs:
        logs.extractall(tmp_path / "logs", filter="data")
    log = {p.stem: p.read_text() for p in (tmp_path / "logs" / "logs").glob("*.log")}
    # Every `gpu` test was collected, and skipped here with the one reason.
    assert re.search(
        r"SKIPPED \[\d+\] tests/conftest.py:\d+: gpu: torch.cuda is not available", log["gpu-tests"]
    ), log["gpu-tests"]
    # gpu.py: one process, pipejob (auto) and torch's 1F1B on each small workload.
    for workload in ("resnet18-32", "transformer-2x64"):
        bench = log["gpu-bench"]
        assert re.search(rf"{workload}: one process [\d.]+ samples/s", bench), bench
        assert re.search(
            rf"{workload}: pipejob 2 stages, microBatches auto, chose \d+:"
            r" [\d.]+ samples/s \([\d.]+x\)",
            bench,
        ), bench
        assert re.search(rf"{workload}: 1F1B 2 stages [\d.]+ samples/s", bench), bench
    assert "HybridJob 'device-hybrid' succeeded" in log["hybrid"], log["hybrid"]
    # The transfer: a CPU tensor's send over RPC (CUDA ones where there is a GPU).
    assert re.search(r"rpc, cpu tensor 8 MB: +[\d.]+ ms", log["transfer"]), log["transfer"]
    # The profiles: a trace per process of the world for each workload, and the master's
    # parts of each profiled step recapped.
    profiles = tmp_path / "logs" / "logs" / "profiles"
    recap = log["profile"].split("== where each profiled step's time went")[-1]
    for workload in ("resnet50-32", "transformer-2x64"):
        traces = sorted(p.name for p in (profiles / workload).glob("*.json"))
        assert traces == ["master-step4.json", "stage0-step4.json", "stage1-step4.json"], traces
        parts = re.search(
            rf"^{workload}:\nmaster \| profile of step 4, its parts: (.*)$", recap, re.M
        )
        assert parts, recap
        said = re.findall(r"([a-z][a-z -]*?) [\d.]+ ms", parts[1].replace(",", ""))
        # The jobs name no engine: auto's, pipelining here (rpc where the stages share a GPU).
        assert said[:3] == ["read", "schedule", "gradient norms"], said
    assert log["profile"].count("engine auto chose pipelining") == 2, log["profile"]
    # overhead.py: each system's fit, pipejob's against torch's schedule.
    for system in ("rpc", "gpipe", "torch-gpipe"):
        assert re.search(
            rf"^\s+2\s+tiny\s+{system}\s+-?[\d.]+\s+-?[\d.]+", log["overhead"], re.M
        ), log["overhead"]
    # and each pipejob system's gap to torch's same schedule, turn by turn.
    for system in ("rpc", "gpipe"):
        assert re.search(
            rf"^\s+2\s+tiny\s+{system}\s+torch-gpipe\s+-?[\d.]+\s+-?[\d.]+\s+[\d.]+  1:[+-]",
            log["overhead"],
            re.M,
        ), log["overhead"]
    # The sweep: every system, at the core count the rehearsal has.
    cores = log["cores"]
    for system in ("pipejob", "pipejob-1f1b", "pipejob-auto", "gpipe", "1f1b", "single-tN"):
        assert re.search(rf"^  {re.escape(system)}\s+\S+\s+[\d.]+ \[", cores, re.M), cores


@pytest.mark.timeout(240)
def test_a_step_that_fails_fails_the_script(tmp_path: Path):
    """The rehearsal above passes only if every step does, which the script's exit says: a
    failed step (here the install, with a Python that cannot run) is FAILED in the summary
    and the script exits 1; with a Python that runs, the same call exits 0 (issue 61: a
    failed part must not pass unseen). In `make test`: a pip install, no world."""

    def run(python: str, out: Path) -> tuple[int, str]:
        done = subprocess.run(
            [str(ROOT / "benchmarks" / "device.sh"), "--cpu", "--only", "machine", "--out", out],
            capture_output=True,
            text=True,
            timeout=200,
            env=os.environ | {"PYTHON": python, "TMPDIR": str(tmp_path)},
        )
        return done.returncode, (out / "summary.txt").read_text()

    code, summary = run("false", tmp_path / "broken")
    assert code == 1, summary
    assert re.search(r"^  install: FAILED, exit \d+ \(\d+s\)$", summary, re.M), summary
    assert re.search(r"^  machine: ok \(\d+s\)$", summary, re.M), summary
    code, summary = run(sys.executable, tmp_path / "whole")
    assert code == 0, summary
    assert re.search(r"^  install: ok \(\d+s\)$", summary, re.M), summary
