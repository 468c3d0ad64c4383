"""What one reconcile asks for (`Actions`: the job's new status, objects to create, pods to
delete, Events to post) and the status changes every situation makes with them. The controller
applies them; reconcile.py decides them (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from pipejob.core.k8s import KubeObject
from pipejob.operator import status as st
from pipejob.operator.status.job_status import JobCondition, JobStatus

NORMAL, WARNING = "Normal", "Warning"


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Actions:
    status: JobStatus  # the job's whole new status
    service: KubeObject | None = None  # create (if absent) before the pods
    policy: KubeObject | None = (
        None  # the world's NetworkPolicy: create (or update) before the pods
    )
    podgroup: KubeObject | None = (
        None  # Volcano or coscheduling: create (or update) before the pods
    )
    create: list[KubeObject] = field(default_factory=list)  # pods
    delete: list[KubeObject] = field(default_factory=list)  # pods, as observed (name and uid)
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False  # ttlSecondsAfterFinished passed
    # Kueue: pods to annotate kueue.x-k8s.io/retriable-in-group=false, which ends the group.
    end_group: list[KubeObject] = field(default_factory=list)


def transition(
    acts: Actions,
    old: JobStatus,
    phase: str,
    reason: str,
    message: str,
    now: datetime,
    event: bool = True,
) -> Actions:
    """Put the status in `phase`; an Event tells when the phase changes."""
    acts.status = st.with_phase(acts.status, phase, reason, message, now)
    if event and old.get("phase") != phase:
        kind = WARNING if phase in (st.FAILED, st.RESTARTING) else NORMAL
        acts.events.append(Event(kind, reason, message))
    return acts


def created_conditions(
    status: JobStatus, true: bool, reason: str, message: str, now: datetime
) -> list[JobCondition]:
    """`status`'s conditions with Created set: whether the world's pods all exist."""
    return st.set_condition(
        list(status.get("conditions") or []), st.CREATED, true, reason, message, now
    )
