"""What gang admission (spec.scheduling) means for a job's status and its end: why a world
waits (the Queued phase), what its admission says, and how a Kueue pod group is ended. Pure
helpers of reconcile.decide."""

from __future__ import annotations

from datetime import datetime, timedelta

from pipejob.core import scheduling as sch
from pipejob.core.k8s import KubeObject
from pipejob.core.spec import Job
from pipejob.operator import gang
from pipejob.operator import status as st
from pipejob.operator.status.job_status import JobStatus

# Kueue: after the master succeeds, how long the other pods get to exit 0 by themselves (a
# Kueue pod group succeeds only when every pod does) before they are stopped.
KUEUE_SUCCESS_GRACE = 30


def queued(job: Job, planned: list[KubeObject], by_name: dict[str, KubeObject]) -> str | None:
    """Why the world waits for its gang scheduler, when every pod exists and it has not
    admitted them yet; else None."""
    section = job.control.scheduling
    pods = [by_name.get(p["metadata"]["name"]) for p in planned]
    if section is None or any(p is None or st.deleting(p) for p in pods):
        return None
    group, size = gang.group_name(job), len(pods)
    if section.provider == sch.KUEUE:
        gated = [p for p in pods if _gated(p)]
        if not gated:
            return None
        return (
            f"Kueue has not admitted pod group {group} ({size} pods) from LocalQueue"
            f" {section.queue} yet: {len(gated)}/{size} pods gated by {sch.KUEUE_GATE}"
            " until its ClusterQueue has quota for all of them"
        )
    if any(p["spec"].get("nodeName") or st.pod_phase(p) != "Pending" for p in pods):
        return None
    scheduler = pods[0]["spec"].get("schedulerName") or section.provider
    queue = f" in queue {section.queue}" if section.queue else ""
    why = next((m for m in map(st.scheduled_message, pods) if m), "")
    return f"{scheduler} has not scheduled PodGroup {group} (minMember {size}){queue} yet" + (
        f": {why}" if why else ""
    )


def _gated(pod: KubeObject) -> bool:
    return any(g.get("name") == sch.KUEUE_GATE for g in pod["spec"].get("schedulingGates") or [])


def admitted(job: Job, size: int) -> str:
    """The Admitted Event's message."""
    section = job.control.scheduling
    if section is not None and section.provider == sch.KUEUE:
        return (
            f"Kueue admitted pod group {gang.group_name(job)} ({size} pods) from LocalQueue"
            f" {section.queue}"
        )
    return f"PodGroup {gang.group_name(job)} scheduled: all {size} pods placed at once"


def end_kueue_group(
    status: JobStatus, current: list[KubeObject], now: datetime
) -> tuple[bool, list[KubeObject]]:
    """For a finished job under Kueue: whether its running pods must be left alone for now,
    and which pods of its world (`current`) to annotate retriable-in-group=false.

    Kueue finishes a pod group when every pod succeeded, or when no pod is active and one is
    so annotated; until then it keeps the group's quota, waiting for replacements. A job that
    succeeded gives its other pods a grace to exit 0; a failed one ends its group."""
    phase = status.get("phase")
    if phase not in st.FINISHED:
        return False, []
    if phase == st.SUCCEEDED:
        done = st.parse_time(status.get("completionTime")) or now
        if now < done + timedelta(seconds=KUEUE_SUCCESS_GRACE):
            return True, []
        if all(st.pod_phase(p) == "Succeeded" for p in current):
            return False, []
    ending = [
        p
        for p in current
        if (p["metadata"].get("annotations") or {}).get(sch.KUEUE_RETRIABLE) != "false"
    ]
    return False, ending
