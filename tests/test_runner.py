"""`pipejob run`: real trainer processes on loopback, stopped together when one fails."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

PIPEJOB = [sys.executable, "-m", "pipejob.cli"]

LONG_PIPELINE = {
    "apiVersion": "pipejob.dev/v1alpha1",
    "kind": "PipelineJob",
    "metadata": {"name": "long"},
    "spec": {
        "model": "resnet18", "stages": 2, "microBatches": 2, "batchSize": 4, "imageSize": 32,
        "numClasses": 10, "steps": 100000, "rendezvousTimeoutSeconds": 60,
    },
}  # fmt: skip


class Run:
    """`pipejob run` in the background, its output lines collected as they come."""

    def __init__(self, manifest: Path):
        self.popen = subprocess.Popen(
            [*PIPEJOB, "run", str(manifest), "--grace", "5"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self._queue.put(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.2)
            except queue.Empty:
                if self.popen.poll() is not None and self._queue.empty():
                    break
                continue
            self.lines.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines))

    def finish(self, timeout: float) -> int:
        code = self.popen.wait(timeout)
        while not self._queue.empty():
            self.lines.append(self._queue.get())
        return code

    @property
    def pids(self) -> dict[str, int]:
        found = (re.search(r"started (\w+) \(rank \d+, pid (\d+)\)", x) for x in self.lines)
        return {m[1]: int(m[2]) for m in found if m}

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        for pid in self.pids.values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"  # a zombie is gone


@pytest.fixture
def long_job(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(LONG_PIPELINE))
    return path


@pytest.mark.timeout(240)
def test_killed_stage_stops_the_world(long_job):
    run = Run(long_job)
    try:
        run.wait_for(r"^master\s*\|.*step 2/", timeout=180)
        pids = run.pids
        assert set(pids) == {"master", "stage0", "stage1"}
        os.kill(pids["stage1"], signal.SIGKILL)
        code = run.finish(timeout=60)
    finally:
        run.kill()
    output = "\n".join(run.lines)
    assert code != 0
    assert "stage1 (role stage, rank 2) failed: killed by signal SIGKILL" in output
    assert not [name for name, pid in pids.items() if alive(pid)], output


@pytest.mark.timeout(240)
def test_interrupting_the_runner_stops_every_process(long_job):
    run = Run(long_job)
    try:
        run.wait_for(r"^master\s*\|.*step 1/", timeout=180)
        pids = run.pids
        run.popen.send_signal(signal.SIGTERM)
        code = run.finish(timeout=60)
    finally:
        run.kill()
    assert code == 130
    assert not [name for name, pid in pids.items() if alive(pid)]


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
