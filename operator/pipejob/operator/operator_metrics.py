"""The operator's Prometheus metrics, in a registry of its own, served on /metrics.

Job counters move on the status transitions the operator itself writes (one reconcile writes
each transition once), so they count what this operator process did; the phase gauge is the
last phase it wrote or read for every job it tracks."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

from pipejob.core.kinds import KINDS
from pipejob.operator import status as st
from pipejob.operator.status.job_status import JobStatus

PREFIX = "pipejob_operator"


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.created = Counter(
            f"{PREFIX}_jobs_created", "Jobs the operator took on.", ["kind"], registry=r
        )
        self.succeeded = Counter(
            f"{PREFIX}_jobs_succeeded", "Jobs that succeeded.", ["kind"], registry=r
        )
        self.failed = Counter(f"{PREFIX}_jobs_failed", "Jobs that failed.", ["kind"], registry=r)
        self.restarted = Counter(
            f"{PREFIX}_jobs_restarted", "Whole-world restarts of jobs.", ["kind"], registry=r
        )
        self.reconcile_seconds = Histogram(
            f"{PREFIX}_reconcile_duration_seconds",
            "Time of one reconcile of a job: read it and its pods, poll, decide, act.",
            ["kind"],
            registry=r,
        )
        self.poll_seconds = Histogram(
            f"{PREFIX}_progress_poll_duration_seconds",
            "Time to fetch a running master's /progress; result ok or none (no report).",
            ["result"],
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        for kind in KINDS:  # every series exists from the start, at zero
            for metric in (
                self.created,
                self.succeeded,
                self.failed,
                self.restarted,
                self.reconcile_seconds,
            ):
                metric.labels(kind)
        for result in ("ok", "none"):
            self.poll_seconds.labels(result)
        self._lock = threading.Lock()
        self._phases: dict[Hashable, tuple[str, str]] = {}  # job -> (kind, phase)
        r.register(_Phases(self))

    def observe(self, job: Hashable, kind: str, old: JobStatus, new: JobStatus) -> None:
        """One reconcile of `job` moved its status from `old` to `new` (maybe the same)."""
        phase = new.get("phase")
        if phase and not old.get("phase"):
            self.created.labels(kind).inc()
        if phase != old.get("phase"):
            if phase == st.SUCCEEDED:
                self.succeeded.labels(kind).inc()
            elif phase == st.FAILED:
                self.failed.labels(kind).inc()
        restarts = int(new.get("restarts") or 0) - int(old.get("restarts") or 0)
        if restarts > 0:
            self.restarted.labels(kind).inc(restarts)
        with self._lock:
            if phase:
                self._phases[job] = (kind, phase)

    def forget(self, job: Hashable) -> None:
        with self._lock:
            self._phases.pop(job, None)

    def phases(self) -> dict[tuple[str, str], int]:
        """{(kind, phase): jobs}, every pair present (zero when none)."""
        counts = {(k, p): 0 for k in KINDS for p in st.PHASES}
        with self._lock:
            for pair in self._phases.values():
                counts[pair] = counts.get(pair, 0) + 1
        return counts

    def serve(self, port: int, host: str = "0.0.0.0"):
        """Serve /metrics on host:port from a daemon thread; returns the HTTP server."""
        try:
            server, _ = start_http_server(port, host, registry=self.registry)
        except OSError as e:
            raise OSError(e.errno, f"cannot serve metrics on {host}:{port}: {e.strerror}") from e
        return server


class _Phases:
    """The jobs-by-phase gauge, computed when scraped."""

    def __init__(self, metrics: OperatorMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            f"{PREFIX}_jobs", "Jobs by kind and phase.", labels=["kind", "phase"]
        )
        for (kind, phase), n in sorted(self.metrics.phases().items()):
            gauge.add_metric([kind, phase], n)
        yield gauge
