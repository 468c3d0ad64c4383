"""Whether a world's other pods wait for its master's own check (core/master_first.py): with no
gang scheduler, the operator makes the Service and the master's pod first and the others once
its /progress phase has left `starting`, so that a master refusing the model, data or loss
fails the job with no other pod ever made. Pure, like situations.py, which asks it."""

from __future__ import annotations

from datetime import datetime, timedelta

from pipejob.core import master_first
from pipejob.core.k8s import KubeObject
from pipejob.operator import status as st
from pipejob.operator.observation import Observed
from pipejob.operator.status.job_status import JobStatus, TrainingStatus

# A master serves /progress as its process starts (before torch loads). Unread this long after
# its container started, the operator cannot reach it (it runs outside the cluster, or a
# NetworkPolicy keeps it out): the others are made then, as if every pod started at once.
UNREAD_SECONDS = 60

WAITING = "the others are created once the master has checked the model, data and loss"


def waiting(seen: Observed, status: JobStatus) -> str | None:
    """Why the current world's other pods are not made yet, or None once they may be: once
    this reconcile's poll of the master (seen.progress) finds it checked, or once it has run
    UNREAD_SECONDS with no report of it ever read (`status`: the new status)."""
    if not master_first.on_cluster(seen.job):
        return None
    others = (seen.by_name.get(p["metadata"]["name"]) for p in seen.planned[1:])
    if any(p is not None and not st.deleting(p) for p in others):
        return None  # the master has checked: what is missing of the others is made
    if seen.progress is not None:  # polled now: the current world's running master's
        return None if master_first.checked(seen.progress.phase) else WAITING
    master = seen.master
    if master is None or _reported_since(status.get("training") or {}, master):
        return WAITING  # the next poll tells
    started = _started(master)
    unread = started is not None and seen.now >= started + timedelta(seconds=UNREAD_SECONDS)
    return None if unread else WAITING


def _reported_since(report: TrainingStatus, master: KubeObject) -> bool:
    """Whether status.training is this master's report: changed after its pod was made (an
    older world's master was gone before this one, of the same name, could be made)."""
    changed = st.parse_time(report.get("updateTime"))
    made = st.parse_time(master["metadata"].get("creationTimestamp"))
    return changed is not None and made is not None and changed >= made


def _started(pod: KubeObject) -> datetime | None:
    """When the pod's container started running."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        started = ((cs.get("state") or {}).get("running") or {}).get("startedAt")
        if started:
            return st.parse_time(started)
    return None
