"""`pipejob run`: real trainer processes on loopback, stopped together when one fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobrun import STARTED, JobRun, pipeline_job

PIPEJOB = [sys.executable, "-m", "pipejob.cli"]

LONG_PIPELINE = pipeline_job("long", stages=2, microBatches=2, batchSize=4, steps=100000)


def pids(run: JobRun) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in STARTED.finditer(run.output)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"  # a zombie is gone


@pytest.mark.timeout(240)
def test_killed_stage_stops_the_world(tmp_path):
    with JobRun(LONG_PIPELINE, tmp_path) as run:
        run.wait_for(r"^master\s*\|.*step 2/", timeout=180)
        started = pids(run)
        assert set(started) == {"master", "stage0", "stage1"}
        os.kill(started["stage1"], signal.SIGKILL)
        code = run.finish(timeout=60)
    assert code != 0
    assert "stage1 (role stage, rank 2) failed: killed by signal SIGKILL" in run.output
    assert not [name for name, pid in started.items() if alive(pid)], run.output


@pytest.mark.timeout(240)
def test_interrupting_the_runner_stops_every_process(tmp_path):
    with JobRun(LONG_PIPELINE, tmp_path) as run:
        run.wait_for(r"^master\s*\|.*step 1/", timeout=180)
        started = pids(run)
        run.popen.send_signal(signal.SIGTERM)
        code = run.finish(timeout=60)
    assert code == 130
    assert not [name for name, pid in started.items() if alive(pid)]


@pytest.mark.timeout(60)
def test_bad_manifest_starts_nothing(tmp_path):
    bad = dict(LONG_PIPELINE, spec={**LONG_PIPELINE["spec"], "stages": 1, "batchSize": 3})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = subprocess.run([*PIPEJOB, "run", str(path)], capture_output=True, text=True,
                            timeout=50)  # fmt: skip
    assert result.returncode == 2
    assert "spec.stages: must be >= 2, got 1" in result.stderr
    assert "started" not in result.stdout + result.stderr
