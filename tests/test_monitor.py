"""The master's /progress and /metrics: the board over real HTTP on loopback, and a running
pipeline world polled as the operator polls it."""

from __future__ import annotations

import json
import math
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobrun import JobRun, pipeline_job
from pipejob.core.contract import Progress
from pipejob.trainer.runtime import monitor

PROGRESS_KEYS = {
    "phase",
    "step",
    "steps",
    "loss",
    "samplesPerSecond",
    "bubble",
    "learningRate",
    "gradNorm",
    "resumedFromStep",
    "preflight",
    "message",
    "evalStep",
    "evalLoss",
    "evalAccuracy",
    "evalPerplexity",
    "evalAuc",
    "memory",
    "engine",
    "checkpointStep",
    "checkpointTime",
}
# Exported only once the master evaluated, each figure only when known.
EVAL_GAUGES = {
    "pipejob_eval_step",
    "pipejob_eval_loss",
    "pipejob_eval_accuracy",
    "pipejob_eval_perplexity",
}
GAUGES = {
    "pipejob_step",
    "pipejob_steps",
    "pipejob_loss",
    "pipejob_samples_per_second",
    "pipejob_step_seconds",
    "pipejob_bubble_ratio",
    "pipejob_stage_forward_seconds",
    "pipejob_stage_backward_seconds",
    "pipejob_learning_rate",
    "pipejob_grad_norm",
    "pipejob_rss_peak_bytes",
}


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text as {(name, labels): value}, parsed by prometheus_client's parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_board_over_http() -> None:
    board = monitor.Board(steps=20)
    server = monitor.BoardServer(board, port=0, host="127.0.0.1")
    base = f"http://127.0.0.1:{server.port}"
    try:
        code, kind, body = get(base + "/progress")
        assert code == 200 and kind == "application/json"
        first = json.loads(body)
        assert set(first) == PROGRESS_KEYS
        assert first["phase"] == "starting" and first["step"] == 0 and first["steps"] == 20
        assert first["loss"] is None and first["preflight"] is None

        board.preflight(True, "3 links")
        board.resumed(10)
        board.phase("training")
        board.step(12, loss=0.75, seconds=0.5, samples=64)
        board.optimizer_figures(lr=0.002, grad_norm=3.5)
        board.stages(0.25, {"stage0": (0.1, 0.2), "stage1": (0.05, 0.15)})
        board.memory("master", {"rssPeakBytes": 5 << 20})
        board.memory("stage0", {"rssPeakBytes": 7 << 20, "cudaPeakBytes": 3 << 20})
        board.checkpointed(12)
        board.runs_on("pipelining")
        progress = json.loads(get(base + "/progress")[2])
        when = progress.pop("checkpointTime")
        assert Progress.parse(progress | {"checkpointTime": when}).checkpointTime == when
        assert progress == {
            "phase": "training",
            "step": 12,
            "steps": 20,
            "loss": 0.75,
            "samplesPerSecond": 128.0,
            "bubble": 0.25,
            "learningRate": 0.002,
            "gradNorm": 3.5,
            "resumedFromStep": 10,
            "preflight": {"ok": True, "message": "3 links"},
            "message": None,
            "evalStep": None,
            "evalLoss": None,
            "evalAccuracy": None,
            "evalPerplexity": None,
            "evalAuc": None,
            "memory": {
                "master": {"rssPeakBytes": 5 << 20},
                "stage0": {"rssPeakBytes": 7 << 20, "cudaPeakBytes": 3 << 20},
            },
            "checkpointStep": 12,
            "engine": "pipelining",
        }
        assert Progress.parse(progress).engine == "pipelining"
        assert Progress.parse(progress | {"engine": "auto"}).engine is None  # not an engine run

        code, kind, text = get(base + "/metrics")
        assert code == 200 and kind.startswith("text/plain")
        got = samples(text)
        assert {name for name, _ in got} == GAUGES | {"pipejob_cuda_peak_bytes"}
        assert got["pipejob_step", ()] == 12 and got["pipejob_steps", ()] == 20
        assert got["pipejob_loss", ()] == 0.75 and got["pipejob_step_seconds", ()] == 0.5
        assert got["pipejob_learning_rate", ()] == 0.002 and got["pipejob_grad_norm", ()] == 3.5
        assert got["pipejob_samples_per_second", ()] == 128
        assert got["pipejob_bubble_ratio", ()] == 0.25
        assert got["pipejob_stage_forward_seconds", (("stage", "stage1"),)] == 0.05
        assert got["pipejob_stage_backward_seconds", (("stage", "stage0"),)] == 0.2
        assert got["pipejob_rss_peak_bytes", (("member", "stage0"),)] == 7 << 20
        assert got["pipejob_cuda_peak_bytes", (("member", "stage0"),)] == 3 << 20
        assert ("pipejob_cuda_peak_bytes", (("member", "master"),)) not in got  # no GPU

        board.step(13, loss=math.nan, seconds=0.5, samples=64)  # JSON has no NaN
        assert json.loads(get(base + "/progress")[2])["loss"] is None
        board.phase("failed", "training failed: RuntimeError: boom")
        failed = json.loads(get(base + "/progress")[2])
        assert failed["phase"] == "failed" and failed["message"].endswith("boom")
        assert get(base + "/other")[0] == 404
        assert not EVAL_GAUGES & {name for name, _ in samples(get(base + "/metrics")[2])}
    finally:
        server.close()


def test_an_evaluation_is_reported_and_exported_once_known() -> None:
    board = monitor.Board(steps=20)
    server = monitor.BoardServer(board, port=0, host="127.0.0.1")
    base = f"http://127.0.0.1:{server.port}"
    try:
        board.step(10, loss=1.5, seconds=0.5, samples=64)
        board.evaluated(10, loss=1.25, accuracy=0.875)  # classification: no perplexity
        progress = json.loads(get(base + "/progress")[2])
        assert set(progress) == PROGRESS_KEYS
        assert (progress["evalStep"], progress["evalLoss"], progress["evalAccuracy"]) == (
            10,
            1.25,
            0.875,
        )
        assert progress["evalPerplexity"] is None and progress["loss"] == 1.5
        got = samples(get(base + "/metrics")[2])
        assert got["pipejob_eval_step", ()] == 10 and got["pipejob_eval_loss", ()] == 1.25
        assert got["pipejob_eval_accuracy", ()] == 0.875
        assert ("pipejob_eval_perplexity", ()) not in got  # unknown: not exported as 0

        board.evaluated(20, loss=2.0, perplexity=math.exp(2.0))  # the language model
        progress = json.loads(get(base + "/progress")[2])
        assert progress["evalStep"] == 20 and progress["evalAccuracy"] is None
        assert progress["evalPerplexity"] == pytest.approx(math.exp(2.0))
        got = samples(get(base + "/metrics")[2])
        assert EVAL_GAUGES <= {name for name, _ in got}
        assert got["pipejob_eval_perplexity", ()] == pytest.approx(math.exp(2.0))
        assert got["pipejob_eval_step", ()] == 20

        board.evaluated(22, loss=0.45, auc=0.75)  # a HybridJob's clicks
        progress = json.loads(get(base + "/progress")[2])
        assert (progress["evalAuc"], progress["evalPerplexity"]) == (0.75, None)
        assert samples(get(base + "/metrics")[2])["pipejob_eval_auc", ()] == 0.75

        board.evaluated(21, loss=math.inf)  # JSON has no infinity either
        assert json.loads(get(base + "/progress")[2])["evalLoss"] is None
        with pytest.raises(ValueError, match="unknown phase"):
            board.phase("running")
    finally:
        server.close()


class Poller:
    """Polls /progress and /metrics of a running master, as the operator and Prometheus do."""

    def __init__(self, base: str):
        self.base, self.progress, self.metrics = base, [], []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            try:
                report = json.loads(get(self.base + "/progress")[2])
                self.progress.append(report)
                if report["phase"] == "training" and report["step"] >= 2:
                    self.metrics.append(get(self.base + "/metrics")[2])
            except OSError:
                pass  # not up yet, or gone
            time.sleep(0.1)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


@pytest.mark.slow  # the board over HTTP in process, above; the operator's poll in test_metrics.py
@pytest.mark.timeout(240)
def test_a_running_pipeline_master_reports_progress_and_metrics(tmp_path: Path) -> None:
    job = pipeline_job("watched", stages=2, microBatches=2, steps=6, preflight={"megabytes": 0.5})
    with JobRun(job, tmp_path) as run:
        url = run.wait_for(r"progress (http://127\.0\.0\.1:\d+)/progress", timeout=30)[1]
        poller = Poller(url)
        try:
            assert run.finish(200) == 0, run.output
        finally:
            poller.close()
    reports: list[dict[str, Any]] = poller.progress
    assert reports and all(set(r) == PROGRESS_KEYS and r["steps"] == 6 for r in reports)
    phases = [r["phase"] for r in reports]
    assert set(phases) <= {"starting", "preflight", "training", "finished"}, phases
    training = [r for r in reports if r["phase"] == "training" and r["step"] >= 1]
    assert training, phases
    steps = [r["step"] for r in training]
    assert steps == sorted(steps) and steps[-1] <= 6
    last = training[-1]
    assert last["loss"] > 0 and last["samplesPerSecond"] > 0 and 0 <= last["bubble"] < 1
    assert last["resumedFromStep"] is None
    assert last["engine"] == "pipelining"  # auto's choice, for the operator's status.engine
    assert last["preflight"]["ok"] and re.match(r"3 links, latency", last["preflight"]["message"])

    assert poller.metrics, "no /metrics scrape while training"
    got = samples(poller.metrics[-1])
    assert {name for name, _ in got} == GAUGES
    assert got["pipejob_steps", ()] == 6 and 2 <= got["pipejob_step", ()] <= 6
    assert got["pipejob_step_seconds", ()] > 0 and got["pipejob_samples_per_second", ()] > 0
    for stage in ("stage0", "stage1"):
        assert got["pipejob_stage_forward_seconds", (("stage", stage),)] > 0
        assert got["pipejob_stage_backward_seconds", (("stage", stage),)] > 0
    assert 0 <= got["pipejob_bubble_ratio", ()] < 1
    # Each member's peak memory, asked for at each logged step: torch alone keeps well over
    # 50 MB resident, and nothing in this world comes near 20 GB.
    memory = next(r["memory"] for r in reversed(reports) if r["memory"])
    assert set(memory) == {"master", "stage0", "stage1"}, memory
    assert all(50e6 < m["rssPeakBytes"] < 20e9 for m in memory.values()), memory
    # The master measures itself at once (the stages answer while training goes on), and a
    # peak only grows.
    assert 50e6 < got["pipejob_rss_peak_bytes", (("member", "master"),)]
    assert (
        got["pipejob_rss_peak_bytes", (("member", "master"),)] <= memory["master"]["rssPeakBytes"]
    )
