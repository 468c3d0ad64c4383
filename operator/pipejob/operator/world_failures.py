"""Which failure broke a job's current world, read from its pods (status/pod_failures.py reads
one pod): the first preemption, the first permanent failure, the first failure by cause, and
whether its cause may still follow. The situations in situations.py act on them."""

from __future__ import annotations

from datetime import datetime, timedelta

from pipejob.core.k8s import KubeObject
from pipejob.operator import kube
from pipejob.operator import status as st
from pipejob.operator.observation import Observed

# A pod that failed only because the world broke under it (a lost peer) often finishes a
# moment before the pod that broke it: while another pod of the world still runs, wait for
# the cause, up to CAUSE_GRACE after the first such failure, so that the job says the cause
# and a permanent one is not retried.
CAUSE_GRACE = timedelta(seconds=30)


def first_failure(seen: Observed) -> st.Failure | None:
    """The failure that broke the current world: the first pod to fail (its peers fail
    after it, for losing it), else a pod deleted or evicted while the world ran."""
    created = st.is_true(seen.old, st.CREATED)
    failures = []
    for rank, planned_pod in enumerate(seen.planned):
        name = planned_pod["metadata"]["name"]
        observed = seen.by_name.get(name)
        process = kube.process_name(planned_pod)
        # A pod deleted while no world stood (suspend) is no failure; it is going anyway.
        if observed is not None and (created or not st.deleting(observed)):
            failure = st.pod_failure(observed, process)
            if failure is not None:
                failures.append((failure.consequence, failure.at or "~", rank, failure))
                continue
        if created and (observed is None or st.deleting(observed)):
            message = f"{process} (pod {name}) was deleted while the job was running"
            failures.append((False, "~", rank, st.Failure("PodDeleted", message)))
    # The first pod to fail by cause: a pod that only lost its peers comes after the others.
    return min(failures, key=lambda f: f[:3])[3] if failures else None


def cause_may_follow(failure: st.Failure, current: list[KubeObject], now: datetime) -> bool:
    """Whether `failure`, a pod's that only lost a peer, may yet be followed by its cause:
    another pod of the world still runs, within CAUSE_GRACE of it."""
    if not failure.consequence or all(st.terminated(p) for p in current):
        return False
    try:
        finished = datetime.fromisoformat(failure.at.replace("Z", "+00:00"))
    except ValueError:
        return False
    return now - finished < CAUSE_GRACE


def preemption(seen: Observed) -> st.Failure | None:
    """The first pod of the current world (by rank) preempted, evicted or disrupted."""
    for planned_pod in seen.planned:
        observed = seen.by_name.get(planned_pod["metadata"]["name"])
        found = st.disruption(observed, kube.process_name(planned_pod)) if observed else None
        if found is not None:
            return found
    return None


def permanent_failure(seen: Observed) -> st.Failure | None:
    """The first permanent failure (by finishing time, then rank) of the current world: the
    trainer's own verdict, or an image that cannot run it."""
    found = []
    for rank, planned_pod in enumerate(seen.planned):
        observed = seen.by_name.get(planned_pod["metadata"]["name"])
        if observed is None:
            continue
        process = kube.process_name(planned_pod)
        failure = st.permanent_failure(observed, process) or st.image_failure(observed, process)
        if failure is not None:
            found.append((failure.at or "~", rank, failure))
    return min(found, key=lambda f: f[:2])[2] if found else None
