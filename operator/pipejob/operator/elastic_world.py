"""An elastic world ({min, max} of a PipelineJob's replicas or a HybridJob's trainers): the size
the current world runs at, when to restart it smaller (`shrink`: pods unschedulable for
spec.elastic.pendingSeconds) or larger (`grow`: its standby pods run, and a checkpoint came
after), and the standby pods that show when capacity returns. Pure helpers of the reconcile's
situations; docs/user-guide.md, "Elastic worlds", tells what a user sees."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import datetime, timedelta

from pipejob.core import scheduling as sch
from pipejob.core.elastic import elastic_size
from pipejob.core.k8s import KubeObject
from pipejob.core.plan import Member, members, plan_world
from pipejob.core.spec import Job
from pipejob.operator import gang, kube
from pipejob.operator import status as st
from pipejob.operator.status.job_status import JobStatus, TrainingStatus

STANDBY_LABEL = "pipejob.dev/standby"  # a standby pod: the number of the world it waits beside
JOINS_LABEL = "pipejob.dev/joins-at"  # the size at which the member it stands for joins
# Standby pods hold their place and nothing else: a process that waits for its SIGTERM.
STANDBY_COMMAND = ["python", "-c", "import signal; signal.pause()"]


@dataclass(frozen=True)
class Resize:
    size: int
    reason: str  # ScaledDown | ScaledUp
    message: str


def size(job: Job, status: JobStatus) -> int | None:
    """The size the current world runs at: the one the operator chose (status.replicas or
    status.trainers) within the spec's bounds; at first the largest. None: the kind has no
    size."""
    found = elastic_size(job.definition, job.settings)
    if found is None:
        return None
    chosen = status.get(job.definition.elastic or "")
    return chosen if isinstance(chosen, int) and found.min <= chosen <= found.max else found.max


def is_standby(pod: KubeObject) -> bool:
    return STANDBY_LABEL in (pod["metadata"].get("labels") or {})


def _key(m: Member) -> tuple[str, int, int]:
    return m.role, m.replica, m.index


def joiners(job: Job, at: int) -> list[tuple[int, Member]]:
    """The members larger worlds add to one of size `at`, each with the size it joins at,
    in rank order (a replica's stages, or a trainer, per size)."""
    found = elastic_size(job.definition, job.settings)
    assert found is not None
    seen = {_key(m) for m in members(job.sized(at))}
    out = []
    for n in range(at + 1, found.max + 1):
        for m in members(job.sized(n)):
            if _key(m) not in seen:
                out.append((n, m))
                seen.add(_key(m))
    return out


# ------------------------------------------------------------------ smaller


def _pending_since(pod: KubeObject) -> datetime | None:
    """Since when the scheduler has found no place for `pod`, or None."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if (c.get("type"), c.get("status"), c.get("reason")) == (
            "PodScheduled",
            "False",
            "Unschedulable",
        ):
            return st.parse_time(c.get("lastTransitionTime"))
    return None


def shrink(
    job: Job,
    at: int,
    planned: list[KubeObject],
    by_name: dict[str, KubeObject],
    old: JobStatus,
    now: datetime,
) -> Resize | None:
    """The smaller size to restart the world `planned` (at size `at`) at, once pods of it
    stayed unplaced for pendingSeconds: the largest whose pods were placed (the world's other
    pods placed too), or, for a world a gang scheduler keeps Queued (nothing of it is placed
    until all is), one size smaller; None while they may yet be placed, or when no smaller
    size (of at least min) would fit either."""
    found = elastic_size(job.definition, job.settings)
    if found is None or at <= found.min:
        return None
    wait = job.control.pending_seconds
    long_ago = now - timedelta(seconds=wait)
    observed = [by_name.get(p["metadata"]["name"]) for p in planned]
    stuck = [p for p in observed if p is not None and (t := _pending_since(p)) and t <= long_ago]
    queued = st.condition(old, st.QUEUED) or {}
    since = st.parse_time(queued.get("lastTransitionTime"))
    if stuck:
        # The size whose pods were placed, if the world's other pods were (they may need the
        # room of the elastic role's pods: then a size smaller).
        role = joiners(job, found.min)[0][1].role
        placed = [
            (kube.role_of(p) == role, bool(o and o["spec"].get("nodeName")))
            for p, o in zip(planned, observed, strict=True)
        ]
        unit = sum(1 for n, _ in joiners(job, at - 1) if n == at)
        fits = sum(ok for grows, ok in placed if grows) // unit
        new = min(fits, at - 1) if all(ok for grows, ok in placed if not grows) else at - 1
        why = st.scheduled_message(stuck[0])
        cause = f"{len(stuck)} pods Pending" + (f": {why}" if why else "")
    elif old.get("phase") == st.QUEUED and since is not None and since <= long_ago:
        new = at - 1
        cause = f"not admitted in {wait}s: {queued.get('message')}"
    else:
        return None
    if new < found.min:
        return None
    field = job.definition.elastic
    return Resize(new, "ScaledDown", f"scaled from {at} to {new} {field}: {cause}")


# ------------------------------------------------------------------ larger


def standby(
    job: Job,
    at: int | None,
    world: int,
    namespace: str,
    owner: KubeObject | None,
    image: str | None,
) -> list[KubeObject]:
    """The standby pods beside world `world` at size `at`: one per member a larger world adds,
    shaped as that member's pod, running nothing."""
    found = elastic_size(job.definition, job.settings)
    if found is None or at is None or at >= found.max:
        return []
    full = job.sized(None)
    processes = {_key(p.member): p for p in plan_world(full, kube.addresser(full))}
    out = []
    for k, (joins, member) in enumerate(joiners(job, at)):
        pod = kube.pod(full, processes[_key(member)], world, namespace, owner, image)
        out.append(_standing_by(job, pod, world, joins, k))
    return out


def _standing_by(job: Job, pod: KubeObject, world: int, joins: int, k: int) -> KubeObject:
    """A member's pod made a standby pod: its resources and placement, no training."""
    pod = copy.deepcopy(pod)
    meta, spec = pod["metadata"], pod["spec"]
    container = spec["containers"][0]
    meta["name"] = f"{job.name}-standby-{world}-{k}"
    meta["labels"] = {
        kube.JOB_LABEL: job.name,
        kube.ROLE_LABEL: kube.role_of(pod),
        STANDBY_LABEL: str(world),
        JOINS_LABEL: str(joins),
        **kube.MANAGED_BY,
    }
    meta["annotations"] = {}
    for key in ("hostname", "subdomain", "volumes", "schedulerName", "serviceAccountName"):
        spec.pop(key, None)
    spec["automountServiceAccountToken"] = False
    for key in ("env", "ports", "volumeMounts"):
        container.pop(key, None)
    container["command"] = list(STANDBY_COMMAND)
    section = job.control.scheduling
    if section is not None and section.provider == sch.KUEUE:  # a pod group per size
        unit = sum(1 for n, _ in joiners(job, joins - 1) if n == joins)
        meta["labels"][sch.KUEUE_QUEUE_LABEL] = section.queue
        meta["labels"][sch.KUEUE_GROUP_LABEL] = f"{gang.group_name(job)}-standby-{world}-{joins}"
        meta["annotations"][sch.KUEUE_TOTAL_COUNT] = str(unit)
    return pod


def grow(job: Job, at: int, pods: list[KubeObject], training: TrainingStatus) -> Resize | None:
    """The larger size to restart the world (at size `at`) at: the largest whose standby
    `pods` all run, once the master has written a checkpoint since the last of them started."""
    found = elastic_size(job.definition, job.settings)
    if found is None or at >= found.max:
        return None
    by_size: dict[int, list[KubeObject]] = {}
    for pod in pods:
        by_size.setdefault(int(pod["metadata"]["labels"][JOINS_LABEL]), []).append(pod)
    wanted = {}
    for n, _ in joiners(job, at):
        wanted[n] = wanted.get(n, 0) + 1
    new, ready = at, []
    for n in range(at + 1, found.max + 1):
        running = [p for p in by_size.get(n, []) if st.pod_phase(p) == "Running"]
        if len(running) < wanted[n]:
            break
        new, ready = n, ready + running
    if new == at:
        return None
    starts = [st.parse_time((p.get("status") or {}).get("startTime")) for p in ready]
    written = st.parse_time(training.get("checkpointTime"))
    if written is None or None in starts or written <= max(starts):
        return None
    field = job.definition.elastic
    return Resize(
        new,
        "ScaledUp",
        f"scaled from {at} to {new} {field}: {len(ready)} standby"
        f" pods run (capacity returned); resuming from the checkpoint of step"
        f" {training.get('checkpointStep')}",
    )


def standby_changes(
    job: Job,
    at: int | None,
    world: int,
    pods: list[KubeObject],
    running: bool,
    namespace: str,
    owner: KubeObject | None,
    image: str,
) -> tuple[list[KubeObject], list[KubeObject]]:
    """The standby pods to make and those to delete beside world `world` at size `at`, given
    those that exist (`pods`): made once every pod of the world runs (`running`: never
    competing with it for room), gone once the world is not the one they wait beside, or no
    longer below its largest size."""
    wanted = standby(job, at, world, namespace, owner, image)
    names = {p["metadata"]["name"] for p in wanted}
    stale = [p for p in pods if p["metadata"]["name"] not in names and not st.deleting(p)]
    have = {p["metadata"]["name"] for p in pods}
    make = [p for p in wanted if p["metadata"]["name"] not in have] if running else []
    return make, stale


def resize(
    job: Job,
    at: int | None,
    planned: list[KubeObject],
    by_name: dict[str, KubeObject],
    pods: list[KubeObject],
    old: JobStatus,
    status: JobStatus,
    now: datetime,
) -> Resize | None:
    """Another size for an elastic world: larger while it runs (`grow`, its standby `pods`),
    smaller while it waits (`shrink`)."""
    if at is None:
        return None
    if old.get("phase") == st.RUNNING:
        return grow(job, at, pods, status.get("training") or {})
    return shrink(job, at, planned, by_name, old, now)
