"""A world whose first objects the API server refused (its NetworkPolicy, its PodGroup) gets
no pods: they would run open, or wait for their PodGroup forever. The reconcile's actions
lose them, and the job's status and a Warning say why; the next reconcile tries again."""

from __future__ import annotations

from datetime import datetime

from pipejob.operator import status as st
from pipejob.operator.actions import WARNING, Actions, Event
from pipejob.operator.status.job_status import JobStatus


def without_podgroup(acts: Actions, old: JobStatus, error: str, now: datetime) -> Actions:
    """`acts` when the API server refused the world's PodGroup (its CRD not installed, or the
    operator not allowed to make it)."""
    kind = (acts.podgroup or {}).get("apiVersion", "PodGroup")
    message = (
        f"cannot create the world's PodGroup ({kind}): {error}; is the scheduler"
        " installed and its chart value scheduling.<provider>.enabled on?"
    )
    return _refused(acts, old, "PodGroupRefused", message, now)


def without_policy(acts: Actions, old: JobStatus, error: str, now: datetime) -> Actions:
    """`acts` when the API server refused the world's NetworkPolicy (the operator not allowed
    to make it, or another's policy holds its name)."""
    name = (acts.policy or {}).get("metadata", {}).get("name")
    message = (
        f"cannot create or update the world's NetworkPolicy {name!r}: {error}; the"
        " chart value networkPolicy.jobs.enabled lets the operator make it, and a"
        " NetworkPolicy of that name that is not the job's must be renamed"
    )
    return _refused(acts, old, "NetworkPolicyRefused", message, now)


def _refused(acts: Actions, old: JobStatus, reason: str, message: str, now: datetime) -> Actions:
    acts.create, acts.policy, acts.podgroup = [], None, None
    conditions = list(acts.status.get("conditions") or [])
    acts.status["conditions"] = st.set_condition(
        conditions, st.CREATED, False, reason, message, now
    )
    acts.status = st.with_phase(acts.status, st.PENDING, reason, message, now)
    acts.events = [e for e in acts.events if e.reason != "CreatedPods"]
    if (st.condition(old, st.CREATED) or {}).get("message") != message:  # said once
        acts.events.append(Event(WARNING, reason, message))
    return acts
