"""The master's live progress: GET /progress (JSON) and GET /metrics (Prometheus text).

The operator polls /progress of the master pod and copies it into the job's status; anyone
may scrape /metrics. Pods need no Kubernetes API rights for either. The server runs in a
daemon thread and only reads a snapshot under a lock, so it never holds up training."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from pipejob.core.contract import HEARTBEAT_PATH, PHASES, PreflightResult, Progress

if TYPE_CHECKING:
    from pipejob.trainer.runtime.watchdog import HeartbeatReply


class Board:
    """What the master knows about the run, as /progress reports it and /metrics exports it."""

    def __init__(self, steps: int):
        self._lock = threading.Lock()
        self._progress = Progress(step=0, steps=steps, phase="starting")
        self.registry = CollectorRegistry()
        gauge = lambda name, doc, *labels: Gauge(name, doc, labels, registry=self.registry)  # noqa: E731
        self._step = gauge("pipejob_step", "Training steps completed.")
        self._steps = gauge("pipejob_steps", "Training steps the job runs in all.")
        self._loss = gauge("pipejob_loss", "Loss of the last completed step.")
        self._rate = gauge("pipejob_samples_per_second", "Samples per second of the last step.")
        self._seconds = gauge("pipejob_step_seconds", "Wall seconds of the last step.")
        self._lr = gauge("pipejob_learning_rate", "Learning rate of the last optimizer step.")
        self._grad_norm = gauge(
            "pipejob_grad_norm", "Global L2 norm of the last step's gradients, before clipping."
        )
        self._bubble = gauge(
            "pipejob_bubble_ratio", "Idle share of stage time in the last measured step."
        )
        self._forward = gauge(
            "pipejob_stage_forward_seconds", "Seconds a stage computed forwards in a step.", "stage"
        )
        self._backward = gauge(
            "pipejob_stage_backward_seconds",
            "Seconds a stage computed backwards in a step.",
            "stage",
        )
        self._rss_peak = gauge(
            "pipejob_rss_peak_bytes",
            "Peak resident memory (VmHWM) of a member of the world.",
            "member",
        )
        self._cuda_peak = gauge(
            "pipejob_cuda_peak_bytes",
            "Peak GPU memory torch allocated in a member of the world (one that uses a GPU).",
            "member",
        )
        self._steps.set(steps)
        self._evals: dict[str, Gauge] = {}
        self.longest_step = 0.0  # wall seconds of the slowest step so far (the watchdog's)
        # Answers a member's heartbeat (runtime/watchdog.py sets it on the master).
        self.on_heartbeat: Callable[[object], HeartbeatReply] | None = None

    def progress(self) -> Progress:
        """The master's report as it is now (/progress serves it as JSON)."""
        with self._lock:
            return self._progress

    def phase(self, phase: str, message: str | None = None) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        with self._lock:
            self._progress = replace(
                self._progress, phase=phase, message=message or self._progress.message
            )

    def preflight(self, ok: bool, message: str) -> None:
        with self._lock:
            self._progress = replace(self._progress, preflight=PreflightResult(ok, message))

    def runs_on(self, engine: str) -> None:
        """The engine the master runs the job on (a PipelineJob's; auto's choice)."""
        with self._lock:
            self._progress = replace(self._progress, engine=engine)

    def checkpointed(self, step: int) -> None:
        """The checkpoint of `step` is complete (its manifest written)."""
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with self._lock:
            self._progress = replace(self._progress, checkpointStep=step, checkpointTime=when)

    def resumed(self, step: int) -> None:
        with self._lock:
            self._progress = replace(self._progress, resumedFromStep=step, step=step)
        self._step.set(step)

    def step(self, step: int, loss: float, seconds: float, samples: int) -> None:
        """A completed step: `samples` trained in `seconds` of wall time."""
        rate = samples / seconds if seconds > 0 else None
        with self._lock:
            self._progress = replace(
                self._progress, step=step, loss=_finite(loss), samplesPerSecond=rate
            )
        self._step.set(step)
        self.longest_step = max(self.longest_step, seconds)
        if _finite(loss) is not None:
            self._loss.set(loss)
        self._seconds.set(seconds)
        if rate is not None:
            self._rate.set(rate)

    def optimizer_figures(self, lr: float | None, grad_norm: float | None) -> None:
        """The last step's learning rate and global gradient norm (None: not known)."""
        with self._lock:
            self._progress = replace(
                self._progress, learningRate=_finite(lr), gradNorm=_finite(grad_norm)
            )
        for gauge, value in ((self._lr, lr), (self._grad_norm, grad_norm)):
            if _finite(value) is not None:
                gauge.set(value)

    def evaluated(
        self,
        step: int,
        loss: float,
        accuracy: float | None = None,
        perplexity: float | None = None,
        auc: float | None = None,
    ) -> None:
        """An evaluation on held-out data after `step`: its loss, and accuracy
        (classification), perplexity (the language model) or AUC (clicks) where known."""
        figures = {
            "evalLoss": _finite(loss),
            "evalAccuracy": _finite(accuracy),
            "evalPerplexity": _finite(perplexity),
            "evalAuc": _finite(auc),
        }
        with self._lock:
            self._progress = replace(self._progress, evalStep=step, **figures)
        # Made on first use: a job that never evaluates exports no eval series (a 0 would
        # read as a perfect loss).
        self._eval_gauge("pipejob_eval_step", "Step of the last evaluation.").set(step)
        for name, value in figures.items():
            if value is not None:
                self._eval_gauge(*_EVAL_GAUGES[name]).set(value)

    def _eval_gauge(self, name: str, doc: str) -> Gauge:
        with self._lock:
            if name not in self._evals:
                self._evals[name] = Gauge(name, doc, registry=self.registry)
            return self._evals[name]

    def stages(self, bubble: float, times: dict[str, tuple[float, float]]) -> None:
        """The pipeline's measured bubble and each stage's (forward, backward) seconds."""
        with self._lock:
            self._progress = replace(self._progress, bubble=bubble)
        self._bubble.set(bubble)
        for stage, (forward, backward) in times.items():
            self._forward.labels(stage=stage).set(forward)
            self._backward.labels(stage=stage).set(backward)

    def memory(self, member: str, figures: dict[str, int]) -> None:
        """A member's peak memory so far (runtime/memory.py's `peak`)."""
        with self._lock:
            every = {**(self._progress.memory or {}), member: dict(figures)}
            self._progress = replace(self._progress, memory=every)
        self._rss_peak.labels(member=member).set(figures["rssPeakBytes"])
        if "cudaPeakBytes" in figures:
            self._cuda_peak.labels(member=member).set(figures["cudaPeakBytes"])

    def metrics(self) -> bytes:
        return generate_latest(self.registry)


_EVAL_GAUGES = {
    "evalLoss": ("pipejob_eval_loss", "Loss on the held-out data at the last evaluation."),
    "evalAccuracy": (
        "pipejob_eval_accuracy",
        "Held-out accuracy (0 to 1) at the last evaluation.",
    ),
    "evalPerplexity": (
        "pipejob_eval_perplexity",
        "Held-out perplexity at the last evaluation (language model).",
    ),
    "evalAuc": (
        "pipejob_eval_auc",
        "Held-out AUC at the last evaluation (a HybridJob's clicks).",
    ),
}


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class _Handler(BaseHTTPRequestHandler):
    board: Board

    def do_GET(self) -> None:  # the http.server API
        path = self.path.split("?", 1)[0]
        if path == "/progress":
            self._send(
                200, "application/json", json.dumps(self.board.progress().to_json()).encode()
            )
        elif path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, self.board.metrics())
        else:
            self._send(404, "text/plain", b"not found: try /progress or /metrics\n")

    def do_POST(self) -> None:  # the http.server API
        answer = self.board.on_heartbeat
        if self.path.split("?", 1)[0] != HEARTBEAT_PATH or answer is None:
            self._send(404, "text/plain", b"not found\n")
            return
        try:
            length = min(int(self.headers.get("Content-Length") or 0), 4096)
            report = json.loads(self.rfile.read(length) or b"null")
        except ValueError:
            self._send(400, "text/plain", b"a heartbeat is a JSON object\n")
            return
        self._send(200, "application/json", json.dumps(answer(report)).encode())

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # a poll every few seconds is not news


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hung up before its answer (a member's heartbeat timing out on a busy
        node) is no error of the server's; anything else still prints its traceback."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class BoardServer:
    """The board's HTTP endpoint, in a daemon thread."""

    def __init__(self, board: Board, port: int, host: str = "0.0.0.0"):
        handler = type("Handler", (_Handler,), {"board": board})
        try:
            self.httpd = _HTTPServer((host, port), handler)
        except OSError as e:
            raise OSError(f"cannot serve /progress and /metrics on port {port}: {e}") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="pipejob-monitor", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# This process's board. Only the master serves it; other processes' updates go nowhere.
_board: Board | None = None


def serve(steps: int, port: int, host: str = "0.0.0.0") -> Board:
    """Create this process's board and serve it on `host`:`port` (the master does, first
    thing)."""
    global _board
    _board = Board(steps)
    BoardServer(_board, port, host)
    return _board


def board() -> Board:
    """This process's board; an unserved one if `serve` was not called (e.g. in tests)."""
    global _board
    if _board is None:
        _board = Board(0)
    return _board
