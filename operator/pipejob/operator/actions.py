"""What one reconcile asks for (`Actions`: the job's new status, objects to create, pods to
delete, Events to post) and the status changes every situation makes with them. The controller
applies them; reconcile.py decides them (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from pipejob.operator import status as st

NORMAL, WARNING = "Normal", "Warning"


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Actions:
    status: dict  # the job's whole new status
    service: dict | None = None  # create (if absent) before the pods
    policy: dict | None = None  # the world's NetworkPolicy: create (or update) before the pods
    podgroup: dict | None = None  # Volcano or coscheduling: create (or update) before the pods
    create: list[dict] = field(default_factory=list)  # pods
    delete: list[dict] = field(default_factory=list)  # pods, as observed (name and uid)
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False  # ttlSecondsAfterFinished passed
    # Kueue: pods to annotate kueue.x-k8s.io/retriable-in-group=false, which ends the group.
    end_group: list[dict] = field(default_factory=list)


def transition(
    acts: Actions,
    old: dict,
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
    status: dict, true: bool, reason: str, message: str, now: datetime
) -> list[dict]:
    """`status`'s conditions with Created set: whether the world's pods all exist."""
    return st.set_condition(
        list(status.get("conditions") or []), st.CREATED, true, reason, message, now
    )
