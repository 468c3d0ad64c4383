"""The operator's one decision: from what is observed (the job object and its pods) to what
to do (status, pods to create or delete, events). Pure and level-based: it reads no memory
of earlier calls, so the operator can be restarted at any moment and converges again.

Over 400 lines because every situation of a job's life is decided here, in one pass, in the
order they take precedence; what gang schedulers and elastic sizes add is decided in
queueing.py, gang.py and elastic.py, and only applied here."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from pipejob.core import scheduling as sch
from pipejob.core.contract import Progress
from pipejob.core.spec import InvalidSpec, Job, parse
from pipejob.operator import elastic, gang, kube, queueing
from pipejob.operator import status as st
from pipejob.operator.policy_settings import DEFAULT, Settings
from pipejob.operator.progress import final_report

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


def owned(pod: dict, uid: str | None) -> bool:
    return any(
        ref.get("controller") and ref.get("uid") == uid
        for ref in pod["metadata"].get("ownerReferences") or []
    )


def decide(
    job_obj: dict,
    pods: list[dict],
    now: datetime,
    image: str,
    progress: Progress | None = None,
    allow_node_volumes: bool = False,
    policy: Settings | None = DEFAULT,
) -> Actions:
    """What to do about `job_obj` given `pods` (every pod labelled with its name) and, when
    the caller polled it, the `progress` its current world's master reported;
    without one the last reported figures stay. `allow_node_volumes` is the operator's
    allowance of hostPath and other node-level volumes; `policy` its settings of the worlds'
    NetworkPolicies (None: none)."""
    acts = _decide(job_obj, pods, now, image, progress, allow_node_volumes, policy)
    scheduling = (job_obj.get("spec") or {}).get("scheduling")
    if isinstance(scheduling, dict) and scheduling.get("provider") == sch.KUEUE:
        uid = job_obj["metadata"].get("uid")
        current = [p for p in pods if owned(p, uid) and kube.restart_of(p) == st.world(acts.status)]
        keep, ending = queueing.end_kueue_group(acts.status, current, now)
        acts.end_group += ending
        if keep:
            acts.delete = []  # they are leaving rpc.shutdown: stopping them fails the group
    return acts


def _decide(
    job_obj: dict,
    pods: list[dict],
    now: datetime,
    image: str,
    progress: Progress | None,
    allow_node_volumes: bool,
    policy: Settings | None,
) -> Actions:
    meta = job_obj["metadata"]
    old = job_obj.get("status") or {}
    everything = [p for p in pods if owned(p, meta.get("uid"))]
    standby = [p for p in everything if elastic.is_standby(p)]  # beside the world, not of it
    ours = [p for p in everything if not elastic.is_standby(p)]
    restarts = int(old.get("restarts") or 0)
    restart = st.world(old)  # the current world's number: restarts + preemptions + resizes
    current = [p for p in ours if kube.restart_of(p) == restart]
    new = dict(old, restarts=restarts, roles=st.role_counts(current, kube.role_of))
    new["observedGeneration"] = meta.get("generation") or old.get("observedGeneration") or 0
    acts = Actions(status=new)
    live = [p for p in everything if not st.deleting(p)]

    if old.get("phase") in st.FINISHED and not _retry_invalid(old, meta):
        # Finished pods stay for `kubectl logs` until the job goes; running ones are stopped
        # (after the master exits, the others would wait in rpc.shutdown forever).
        acts.delete = [p for p in live if not st.terminated(p)]
        ttl = (job_obj.get("spec") or {}).get("ttlSecondsAfterFinished")
        done = st.parse_time(old.get("completionTime"))
        acts.delete_job = isinstance(ttl, int) and done is not None and now >= done + _s(ttl)
        return acts

    try:
        job = parse(
            job_obj, f"{job_obj.get('kind')} {meta.get('name')}", allow_node_volumes, cluster=True
        )
    except InvalidSpec as e:
        message = "; ".join(str(err) for err in e.errors)
        acts.delete = [p for p in live if not st.terminated(p)]
        if (
            old.get("phase") == st.FAILED
            and (st.condition(old, st.FAILED) or {}).get("message") != message
        ):  # edited, still invalid, for another reason: say so
            acts.events.append(Event(WARNING, "InvalidSpec", message))
        return _transition(acts, old, st.FAILED, "InvalidSpec", message, now)

    at = elastic.size(job, old)
    if at is not None:  # the size the world runs at, elastic or fixed
        job = replace(job, size=at, resizes=int(old.get("resizes") or 0))
        acts.status[job.definition.elastic] = at

    if job.spec["suspend"]:
        acts.delete = live
        acts.status.pop("startTime", None)  # the deadline restarts with the job, as for Jobs
        acts.status["conditions"] = _created(acts.status, False, "Suspended", "pods removed", now)
        return _transition(
            acts, old, st.SUSPENDED, "Suspended", "spec.suspend is true: pods removed", now
        )

    if progress is not None:
        acts.status = st.with_report(acts.status, progress, now)
    preflight = st.preflight_failure(current)
    if preflight is not None:
        acts.status = st.with_preflight(acts.status, False, preflight, now)

    start = st.parse_time(old.get("startTime")) or now
    acts.status["startTime"] = st.timestamp(start)
    # An older world's pods go; standby pods are kept or not below.
    acts.delete = [p for p in live if kube.restart_of(p) != restart and not elastic.is_standby(p)]
    by_name = {p["metadata"]["name"]: p for p in current}
    planned = kube.world(
        job, restart, meta.get("namespace") or "default", kube.owner_reference(job_obj), image
    )
    master = by_name.get(planned[0]["metadata"]["name"])

    if master is not None and st.pod_phase(master) == "Succeeded":
        acts.delete = [p for p in live if not st.terminated(p)]
        # The master exits 0 only after the last step: progress shows it, polled or not.
        steps = job.spec["steps"]
        done = {
            **(acts.status.get("training") or {}),
            **final_report(master),
            "phase": "finished",
            "step": steps,
            "steps": steps,
        }
        acts.status = st.with_training(acts.status, done, now)
        return _transition(
            acts,
            old,
            st.SUCCEEDED,
            "MasterSucceeded",
            f"the master (pod {master['metadata']['name']}) exited 0",
            now,
        )

    deadline = job.spec.get("activeDeadlineSeconds")
    if deadline is not None and now >= start + _s(deadline):
        acts.delete = [p for p in live if not st.terminated(p)]
        return _transition(
            acts,
            old,
            st.FAILED,
            "DeadlineExceeded",
            f"the job was active longer than activeDeadlineSeconds ({deadline}s)",
            now,
        )

    # An edited spec makes a new world (an RPC world cannot change shape while it runs); that
    # is no failure, so it costs no restart.
    digest = kube.spec_hash(job)
    if any(kube.spec_hash_of(p) != digest for p in current if not st.deleting(p)):
        acts.delete = live
        message = f"the spec changed (generation {meta.get('generation')}): recreating the world"
        acts.status["conditions"] = _created(acts.status, False, "SpecChanged", message, now)
        acts.events.append(Event(NORMAL, "SpecChanged", message))
        return _transition(acts, old, st.PENDING, "SpecChanged", message, now, event=False)

    preempted = _preemption(planned, by_name)
    if preempted is not None:  # not the job's failure: a new world, no backoffLimit spent
        return _preempt(acts, old, preempted, live, now)
    permanent = _permanent_failure(planned, by_name)
    if permanent is not None:  # a restart would fail the same way: no backoffLimit spent
        acts.delete = [p for p in live if not st.terminated(p)]
        return _transition(acts, old, st.FAILED, permanent.reason, permanent.message, now)
    failure = _first_failure(planned, by_name, created=st.is_true(old, st.CREATED))
    if failure is not None and not _cause_may_follow(failure, current, now):
        return _fail(acts, job, old, failure, live, now)

    resize = elastic.resize(job, at, planned, by_name, standby, old, acts.status, now)
    if resize is not None:  # a world of another size, resumed from its checkpoint
        return _resize(acts, job, old, resize, live, now)

    # Create what is missing; a name still held by any pod (an older world being deleted,
    # or another owner's pod) waits until it is free.
    taken = {p["metadata"]["name"] for p in pods}
    acts.create = [p for p in planned if p["metadata"]["name"] not in taken]
    if gang.provider(job) == sch.KUEUE and any(
        kube.restart_of(p) != restart and not st.terminated(p) for p in ours
    ):  # Kueue counts an older world's live pods in the group: they must stop first
        acts.create = []
    if acts.create:
        namespace, owner = meta.get("namespace") or "default", kube.owner_reference(job_obj)
        acts.service = kube.service(job, namespace, owner)
        if policy is not None:  # made, or put right, with each world
            acts.policy = kube.network_policy(job, namespace, owner, policy)
        acts.podgroup = gang.podgroup(job, planned, namespace, owner)
        acts.events.append(Event(NORMAL, "CreatedPods", _created_message(acts.create, restart)))
    present = [p for p in planned if p["metadata"]["name"] in by_name]
    if len(present) + len(acts.create) == len(planned):
        if not st.is_true(old, st.CREATED):
            acts.status["conditions"] = _created(
                acts.status,
                True,
                "PodsCreated",
                f"the Service and {len(planned)} pods of restart {restart} exist",
                now,
            )

    # Workers leave rpc.shutdown() and exit 0 a moment before the master: that is the world
    # finishing, not pods going missing.
    running = sum(
        1
        for p in current
        if not st.deleting(p)
        and (st.pod_phase(p) == "Running" or (st.pod_phase(p) == "Succeeded" and p is not master))
    )
    _keep_standby(acts, job, at, restart, standby, running == len(planned), job_obj, image)
    queued = queueing.queued(job, planned, by_name)
    if old.get("phase") == st.QUEUED and queued is None:
        acts.events.append(Event(NORMAL, "Admitted", queueing.admitted(job, len(planned))))
    if running == len(planned):
        return _transition(
            acts, old, st.RUNNING, "AllPodsRunning", f"all {running} pods are running", now
        )
    if queued is not None:
        return _transition(acts, old, st.QUEUED, "WaitingForAdmission", queued, now)
    if old.get("phase") == st.RESTARTING:
        # Until the new world runs, the Restarting condition keeps saying what broke the old.
        cause = st.condition(old, st.RESTARTING) or {}
        return _transition(
            acts,
            old,
            st.RESTARTING,
            cause.get("reason") or "Restarting",
            cause.get("message") or f"restart {restart}",
            now,
        )
    message = f"{running}/{len(planned)} pods running"
    stuck = [(p["metadata"]["name"], w) for p in current if (w := st.waiting_message(p))]
    if not stuck:
        return _transition(acts, old, st.PENDING, "PodsPending", message, now)
    # A bad image or a missing secret: said in the Running condition and a Warning, once.
    why = f"pod {stuck[0][0]} cannot start: {stuck[0][1]}"
    acts = _transition(acts, old, st.PENDING, "PodsPending", f"{message}; {why}", now)
    acts.status["conditions"] = st.set_condition(
        list(acts.status["conditions"]), st.RUNNING, False, "PodCannotStart", why, now
    )
    if (st.condition(old, st.RUNNING) or {}).get("message") != why:
        acts.events.append(Event(WARNING, "PodCannotStart", why))
    return acts


def _resize(
    acts: Actions, job: Job, old: dict, resize: elastic.Resize, live: list[dict], now: datetime
) -> Actions:
    """A new world at another size (status.resizes counts it, as part of the world's number);
    it resumes from the last checkpoint, and spends no backoffLimit."""
    acts.delete = live
    acts.status[job.definition.elastic] = resize.size
    acts.status["resizes"] = int(old.get("resizes") or 0) + 1
    conditions = _created(
        acts.status, False, resize.reason, f"the world is being recreated at {resize.size}", now
    )
    acts.status["conditions"] = st.set_condition(
        conditions, st.RESIZED, True, resize.reason, resize.message, now
    )
    kind = WARNING if resize.reason == "ScaledDown" else NORMAL
    acts.events.append(Event(kind, resize.reason, resize.message))
    if gang.provider(job) == sch.KUEUE:  # a group of the old size: Kueue frees its quota
        acts.end_group = [p for p in live if not _ended(p)]
    return _transition(acts, old, st.RESTARTING, resize.reason, resize.message, now, event=False)


def _ended(pod: dict) -> bool:
    return (pod["metadata"].get("annotations") or {}).get(sch.KUEUE_RETRIABLE) == "false"


def _keep_standby(
    acts: Actions,
    job: Job,
    at: int | None,
    restart: int,
    standby: list[dict],
    running: bool,
    job_obj: dict,
    image: str,
) -> None:
    """The standby pods beside the world (elastic.standby_changes): made, and gone."""
    namespace = job_obj["metadata"].get("namespace") or "default"
    make, stale = elastic.standby_changes(
        job, at, restart, standby, running, namespace, kube.owner_reference(job_obj), image
    )
    acts.create += make
    acts.delete += stale
    if gang.provider(job) == sch.KUEUE:  # their groups end: Kueue frees their quota
        acts.end_group += [p for p in stale if not _ended(p)]


def _s(seconds: int) -> timedelta:
    return timedelta(seconds=seconds)


def _retry_invalid(old: dict, meta: dict) -> bool:
    """A job that failed on an invalid spec is looked at again once its spec is edited."""
    failed = st.condition(old, st.FAILED) or {}
    edited = meta.get("generation") != old.get("observedGeneration")
    return old.get("phase") == st.FAILED and failed.get("reason") == "InvalidSpec" and edited


def _first_failure(planned: list[dict], by_name: dict, created: bool) -> st.Failure | None:
    """The failure that broke the current world: the first pod to fail (its peers fail
    after it, for losing it), else a pod deleted or evicted while the world ran."""
    failures = []
    for rank, planned_pod in enumerate(planned):
        name = planned_pod["metadata"]["name"]
        observed = by_name.get(name)
        who = kube.process_name(planned_pod)
        # A pod deleted while no world stood (suspend) is no failure; it is going anyway.
        if observed is not None and (created or not st.deleting(observed)):
            failure = st.pod_failure(observed, who)
            if failure is not None:
                failures.append((failure.consequence, failure.at or "~", rank, failure))
                continue
        if created and (observed is None or st.deleting(observed)):
            failures.append(
                (
                    False,
                    "~",
                    rank,
                    st.Failure(
                        "PodDeleted", f"{who} (pod {name}) was deleted while the job was running"
                    ),
                )
            )
    # The first pod to fail by cause: a pod that only lost its peers comes after the others.
    return min(failures, key=lambda f: f[:3])[3] if failures else None


# A pod that failed only because the world broke under it (a lost peer) often finishes a
# moment before the pod that broke it: while another pod of the world still runs, wait for
# the cause, up to CAUSE_GRACE after the first such failure, so that the job says the cause
# and a permanent one is not retried.
CAUSE_GRACE = timedelta(seconds=30)


def _cause_may_follow(failure: st.Failure, current: list[dict], now: datetime) -> bool:
    if not failure.consequence or all(st.terminated(p) for p in current):
        return False
    try:
        finished = datetime.fromisoformat(failure.at.replace("Z", "+00:00"))
    except ValueError:
        return False
    return now - finished < CAUSE_GRACE


def _preemption(planned: list[dict], by_name: dict) -> st.Failure | None:
    """The first pod of the current world (by rank) preempted, evicted or disrupted."""
    for planned_pod in planned:
        observed = by_name.get(planned_pod["metadata"]["name"])
        found = st.disruption(observed, kube.process_name(planned_pod)) if observed else None
        if found is not None:
            return found
    return None


def _preempt(
    acts: Actions, old: dict, cause: st.Failure, live: list[dict], now: datetime
) -> Actions:
    """A new world for one preempted: counted in status.preemptions, never in restarts."""
    acts.delete = live
    preemptions = int(old.get("preemptions") or 0) + 1
    acts.status["preemptions"] = preemptions
    acts.status["conditions"] = _created(
        acts.status, False, cause.reason, "the world is being recreated", now
    )
    message = (
        f"{cause.message}; recreating the world (preemption {preemptions}, no backoffLimit spent)"
    )
    acts.events.append(Event(WARNING, cause.reason, message))
    return _transition(acts, old, st.RESTARTING, cause.reason, message, now, event=False)


def _permanent_failure(planned: list[dict], by_name: dict) -> st.Failure | None:
    """The first permanent failure (by finishing time, then rank) of the current world: the
    trainer's own verdict, or an image that cannot run it."""
    found = []
    for rank, planned_pod in enumerate(planned):
        observed = by_name.get(planned_pod["metadata"]["name"])
        who = kube.process_name(planned_pod)
        failure = None
        if observed is not None:
            failure = st.permanent_failure(observed, who) or st.image_failure(observed, who)
        if failure is not None:
            found.append((failure.at or "~", rank, failure))
    return min(found, key=lambda f: f[:2])[2] if found else None


def _fail(
    acts: Actions, job: Job, old: dict, failure: st.Failure, live: list[dict], now: datetime
) -> Actions:
    """Restart the whole world (an RPC world cannot re-admit a member), or give up."""
    restart = acts.status["restarts"]
    limit = job.spec["backoffLimit"]
    if restart >= limit:
        acts.delete = [p for p in live if not st.terminated(p)]
        return _transition(
            acts,
            old,
            st.FAILED,
            "BackoffLimitExceeded",
            f"{failure.message}; no restarts left (backoffLimit {limit})",
            now,
        )
    acts.delete = live
    acts.status["restarts"] = restart + 1
    acts.status["conditions"] = _created(
        acts.status, False, failure.reason, "the world is being recreated", now
    )
    message = f"{failure.message}; restarting the world ({restart + 1}/{limit})"
    acts.events.append(Event(WARNING, failure.reason, message))
    return _transition(acts, old, st.RESTARTING, failure.reason, message, now, event=False)


def _transition(
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


def _created(status: dict, true: bool, reason: str, message: str, now: datetime) -> list[dict]:
    return st.set_condition(
        list(status.get("conditions") or []), st.CREATED, true, reason, message, now
    )


def _created_message(pods: list[dict], restart: int) -> str:
    names = ", ".join(p["metadata"]["name"] for p in pods)
    return f"created pods {names}" + (f" (restart {restart})" if restart else "")
