"""The training figures the master reports, and its preflight check, written into the status."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from pipejob.core.contract import PREFLIGHT_PREFIX, Progress, ReportedFigures
from pipejob.core.k8s import KubeObject
from pipejob.operator.status.conditions import PREFLIGHT, set_condition, timestamp
from pipejob.operator.status.job_status import JobStatus
from pipejob.operator.status.pods import pod_phase, tail, trainer_state


def with_preflight(status: JobStatus, ok: bool, message: str, now: datetime) -> JobStatus:
    reason = "PreflightPassed" if ok else "PreflightFailed"
    conditions = set_condition(
        list(status.get("conditions") or []), PREFLIGHT, ok, reason, message or reason, now
    )
    return dict(status, conditions=conditions)


def with_training(status: JobStatus, figures: ReportedFigures, now: datetime) -> JobStatus:
    """`status` showing `figures` (fields of contract.Progress but preflight; None means
    unknown): status.progress as step/steps for `kubectl get`, status.training with the rest;
    updateTime moves only when a figure does, so an unchanged report writes nothing."""
    training = {k: v for k, v in figures.items() if v is not None and k != "preflight"}
    old = status.get("training") or {}
    if training == {k: v for k, v in old.items() if k != "updateTime"}:
        training = old
    else:
        training["updateTime"] = timestamp(now)
    out = dict(status, training=training)
    if "step" in training and "steps" in training:
        out["progress"] = f"{training['step']}/{training['steps']}"
    return out


def with_report(status: JobStatus, report: Progress, now: datetime) -> JobStatus:
    """`status` with what the master's /progress reported."""
    out = with_training(status, report.figures(), now)
    if report.preflight is not None:
        out = with_preflight(out, report.preflight.ok, report.preflight.message, now)
    return out


def with_engine(status: JobStatus, engine: str) -> JobStatus:
    """A PipelineJob's status.engine (`kubectl get`'s Engine): the engine its master reported
    running on (the one `engine: auto` chose), else `engine`, spec.engine as written (auto,
    before the current world's master has chosen)."""
    reported = (status.get("training") or {}).get("engine")
    return {**status, "engine": reported or engine}


def preflight_failure(pods: Iterable[KubeObject]) -> str | None:
    """The termination message of the first failed pod whose preflight check failed."""
    for pod in pods:
        message = (trainer_state(pod).get("message") or "").strip()
        if pod_phase(pod) == "Failed" and message.startswith(PREFLIGHT_PREFIX):
            return tail(message)
    return None
