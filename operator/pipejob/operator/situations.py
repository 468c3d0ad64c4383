"""The situations a job can be in, one function each, and `SITUATIONS`: the order in which they
take precedence. Each reads what a reconcile observed and returns the Actions for its
situation, or None when the job is not in it; reconcile.decide takes the first answer. What
gang schedulers and elastic sizes add is decided in queueing.py, gang.py and elastic_world.py;
docs/architecture.md tells the whole path."""

from __future__ import annotations

from datetime import timedelta

from pipejob.core import oom
from pipejob.core import scheduling as sch
from pipejob.core.k8s import KubeObject
from pipejob.core.spec import InvalidSpec
from pipejob.operator import elastic_world, gang, kube, master_check, oom_kills, queueing
from pipejob.operator import status as st
from pipejob.operator.actions import (
    NORMAL,
    WARNING,
    Actions,
    Event,
    created_conditions,
    transition,
)
from pipejob.operator.observation import Observed
from pipejob.operator.progress import final_report
from pipejob.operator.status.job_status import JobStatus
from pipejob.operator.world_failures import (
    cause_may_follow,
    first_failure,
    permanent_failure,
    preemption,
)


def finished(seen: Observed) -> Actions | None:
    """Succeeded or failed: finished pods stay for `kubectl logs` until the job goes; running
    ones are stopped (after the master exits, the others would wait in rpc.shutdown forever);
    the job goes ttlSecondsAfterFinished after it finished. An invalid spec, once edited, is
    looked at again."""
    old = seen.old
    if old.get("phase") not in st.FINISHED or _retry_invalid(old, seen.meta):
        return None
    acts = Actions(status=seen.status(), delete=_unfinished(seen.live))
    ttl = (seen.job_obj.get("spec") or {}).get("ttlSecondsAfterFinished")
    done = st.parse_time(old.get("completionTime"))
    acts.delete_job = isinstance(ttl, int) and done is not None and seen.now >= done + _seconds(ttl)
    return acts


def invalid(seen: Observed) -> Actions | None:
    """A spec the job cannot run with: its pods stop, and it fails saying why."""
    if not isinstance(seen.parsed, InvalidSpec):
        return None
    message = "; ".join(str(err) for err in seen.parsed.errors)
    acts = Actions(status=seen.status(), delete=_unfinished(seen.live))
    old = seen.old
    if (
        old.get("phase") == st.FAILED
        and (st.condition(old, st.FAILED) or {}).get("message") != message
    ):  # edited, still invalid, for another reason: say so
        acts.events.append(Event(WARNING, "InvalidSpec", message))
    return transition(acts, old, st.FAILED, "InvalidSpec", message, seen.now)


def suspended(seen: Observed) -> Actions | None:
    """spec.suspend: every pod goes; the deadline restarts with the job, as for Jobs."""
    if not seen.job.control.suspend:
        return None
    acts = Actions(status=seen.sized_status(), delete=seen.live)
    acts.status.pop("startTime", None)
    acts.status["conditions"] = created_conditions(
        acts.status, False, "Suspended", "pods removed", seen.now
    )
    message = "spec.suspend is true: pods removed"
    return transition(acts, seen.old, st.SUSPENDED, "Suspended", message, seen.now)


def succeeded(seen: Observed) -> Actions | None:
    """The master exited 0, which it does only after the last step: progress shows it, polled
    or not; the pods still running stop."""
    master = seen.master
    if master is None or st.pod_phase(master) != "Succeeded":
        return None
    acts = Actions(status=seen.active_status(), delete=_unfinished(seen.live))
    steps = seen.job.settings.steps
    done = {
        **(acts.status.get("training") or {}),
        **final_report(master),
        "phase": "finished",
        "step": steps,
        "steps": steps,
    }
    acts.status = seen.with_engine(st.with_training(acts.status, done, seen.now))
    message = f"the master (pod {master['metadata']['name']}) exited 0"
    return transition(acts, seen.old, st.SUCCEEDED, "MasterSucceeded", message, seen.now)


def past_deadline(seen: Observed) -> Actions | None:
    """Active longer than spec.activeDeadlineSeconds: the job fails."""
    deadline = seen.job.control.active_deadline_seconds
    if deadline is None or seen.now < seen.start + _seconds(deadline):
        return None
    acts = Actions(status=seen.active_status(), delete=_unfinished(seen.live))
    message = f"the job was active longer than activeDeadlineSeconds ({deadline}s)"
    return transition(acts, seen.old, st.FAILED, "DeadlineExceeded", message, seen.now)


def spec_changed(seen: Observed) -> Actions | None:
    """An edited spec makes a new world (an RPC world cannot change shape while it runs);
    that is no failure, so it costs no restart."""
    digest = kube.spec_hash(seen.job)
    if all(kube.spec_hash_of(p) == digest for p in seen.current if not st.deleting(p)):
        return None
    acts = Actions(status=seen.active_status(), delete=seen.live)
    generation = seen.meta.get("generation")
    message = f"the spec changed (generation {generation}): recreating the world"
    acts.status["conditions"] = created_conditions(
        acts.status, False, "SpecChanged", message, seen.now
    )
    acts.events.append(Event(NORMAL, "SpecChanged", message))
    return transition(acts, seen.old, st.PENDING, "SpecChanged", message, seen.now, event=False)


def preempted(seen: Observed) -> Actions | None:
    """A pod of the world preempted, evicted or disrupted: not the job's failure, so a new
    world, counted in status.preemptions and spending no backoffLimit."""
    cause = preemption(seen)
    if cause is None:
        return None
    acts = Actions(status=seen.active_status(), delete=seen.live)
    preemptions = int(seen.old.get("preemptions") or 0) + 1
    acts.status["preemptions"] = preemptions
    acts.status["conditions"] = created_conditions(
        acts.status, False, cause.reason, "the world is being recreated", seen.now
    )
    message = (
        f"{cause.message}; recreating the world (preemption {preemptions}, no backoffLimit spent)"
    )
    acts.events.append(Event(WARNING, cause.reason, message))
    return transition(acts, seen.old, st.RESTARTING, cause.reason, message, seen.now, event=False)


def failed_permanently(seen: Observed) -> Actions | None:
    """The trainer's own verdict that a restart would fail the same way, or an image that
    cannot run it: the job fails, spending no backoffLimit."""
    failure = permanent_failure(seen)
    if failure is None:
        return None
    acts = Actions(status=seen.active_status(), delete=_unfinished(seen.live))
    return transition(acts, seen.old, st.FAILED, failure.reason, failure.message, seen.now)


def oom_killed(seen: Observed) -> Actions | None:
    """A member killed for memory (oom_kills.kill): a new world with its role's memory raised
    by spec.oom.increase, counted in status.oomKills and spending no backoffLimit; at the
    cap (spec.oom.maxMemory) the job fails naming the role and the memory it needed."""
    found = oom_kills.kill(seen)
    if found is None or seen.job.control.oom.increase <= 1:
        return None
    had, role = oom.text(found.had), found.role
    killed = f"{found.process} (pod {found.pod}) was killed for memory (OOMKilled) at {had}"
    if found.next <= found.had:
        acts = Actions(status=seen.active_status(), delete=_unfinished(seen.live))
        message = f"{killed}: role {role} needs more than {had}, the most spec.oom.maxMemory allows"
        return transition(acts, seen.old, st.FAILED, "OOMKilled", message, seen.now)
    acts = Actions(status=seen.active_status(), delete=seen.live)
    raised = oom.text(found.next)
    acts.status["oomKills"] = int(seen.old.get("oomKills") or 0) + 1
    acts.status["memory"] = {**(seen.old.get("memory") or {}), role: raised}
    acts.status["conditions"] = created_conditions(
        acts.status, False, "OOMKilled", "the world is being recreated", seen.now
    )
    message = (
        f"{killed}; recreating the world with {raised} for role {role} (no backoffLimit spent)"
    )
    acts.events.append(Event(WARNING, "OOMKilled", message))
    if gang.provider(seen.job) == sch.KUEUE:  # the group of the old shape: Kueue frees its quota
        acts.end_group = [p for p in seen.live if not _ended(p)]
    return transition(acts, seen.old, st.RESTARTING, "OOMKilled", message, seen.now, event=False)


def failed(seen: Observed) -> Actions | None:
    """A pod of the world failed or went: restart the whole world (an RPC world cannot
    re-admit a member) until backoffLimit is spent, then fail. A pod that only lost a peer
    waits a moment for its cause (CAUSE_GRACE)."""
    failure = first_failure(seen)
    if failure is None or cause_may_follow(failure, seen.current, seen.now):
        return None
    acts = Actions(status=seen.active_status())
    restart, limit = acts.status["restarts"], seen.job.control.backoff_limit
    if restart >= limit:
        acts.delete = _unfinished(seen.live)
        message = f"{failure.message}; no restarts left (backoffLimit {limit})"
        return transition(acts, seen.old, st.FAILED, "BackoffLimitExceeded", message, seen.now)
    acts.delete = seen.live
    acts.status["restarts"] = restart + 1
    acts.status["conditions"] = created_conditions(
        acts.status, False, failure.reason, "the world is being recreated", seen.now
    )
    message = f"{failure.message}; restarting the world ({restart + 1}/{limit})"
    acts.events.append(Event(WARNING, failure.reason, message))
    return transition(acts, seen.old, st.RESTARTING, failure.reason, message, seen.now, event=False)


def resized(seen: Observed) -> Actions | None:
    """An elastic world of another size (elastic_world.resize), resumed from its checkpoint: counted
    in status.resizes (part of the world's number), spending no backoffLimit."""
    acts = Actions(status=seen.active_status(), delete=seen.live)
    job, old, now = seen.job, seen.old, seen.now
    found = elastic_world.resize(
        job, seen.size, seen.planned, seen.by_name, seen.standby, old, acts.status, now
    )
    if found is None:
        return None
    acts.status[job.definition.elastic] = found.size
    acts.status["resizes"] = int(old.get("resizes") or 0) + 1
    conditions = created_conditions(
        acts.status, False, found.reason, f"the world is being recreated at {found.size}", now
    )
    acts.status["conditions"] = st.set_condition(
        conditions, st.RESIZED, True, found.reason, found.message, now
    )
    kind = WARNING if found.reason == "ScaledDown" else NORMAL
    acts.events.append(Event(kind, found.reason, found.message))
    if gang.provider(job) == sch.KUEUE:  # a group of the old size: Kueue frees its quota
        acts.end_group = [p for p in seen.live if not _ended(p)]
    return transition(acts, old, st.RESTARTING, found.reason, found.message, now, event=False)


def starting_or_running(seen: Observed) -> Actions:
    """None of the above: an older world's pods go, what is missing of this one is made, and
    the phase says how far the world got (running, queued, restarting or pending)."""
    acts = Actions(status=seen.active_status())
    acts.delete = [
        p
        for p in seen.live
        if kube.restart_of(p) != seen.restart and not elastic_world.is_standby(p)
    ]
    waiting = master_check.waiting(seen, acts.status)
    _create_missing(seen, acts, waiting is None)
    running = _running(seen)
    _keep_standby(seen, acts, running == len(seen.planned))
    queued = queueing.queued(seen.job, seen.planned, seen.by_name)
    if seen.old.get("phase") == st.QUEUED and queued is None:
        admitted = queueing.admitted(seen.job, len(seen.planned))
        acts.events.append(Event(NORMAL, "Admitted", admitted))
    return _starting_phase(seen, acts, running, queued, waiting)


# The order in which the situations take precedence: reconcile.decide takes the first answer.
SITUATIONS = (
    finished,
    invalid,
    suspended,
    succeeded,
    past_deadline,
    spec_changed,
    preempted,
    failed_permanently,
    oom_killed,
    failed,
    resized,
    starting_or_running,
)


def _create_missing(seen: Observed, acts: Actions, others: bool) -> None:
    """The pods of the world not made yet, with the Service, NetworkPolicy and PodGroup before
    them; the master's alone until `others` (master_check.waiting). A name still held by any
    pod (an older world being deleted, or another owner's pod) waits until it is free."""
    taken = {p["metadata"]["name"] for p in seen.pods}
    acts.create = [
        p
        for p in (seen.planned if others else seen.planned[:1])
        if p["metadata"]["name"] not in taken
    ]
    if gang.provider(seen.job) == sch.KUEUE and any(
        kube.restart_of(p) != seen.restart and not st.terminated(p) for p in seen.ours
    ):  # Kueue counts an older world's live pods in the group: they must stop first
        acts.create = []
    if acts.create:
        job, namespace, owner = seen.job, seen.namespace, seen.owner
        acts.service = kube.service(job, namespace, owner)
        if seen.policy is not None:  # made, or put right, with each world
            acts.policy = kube.network_policy(job, namespace, owner, seen.policy)
        acts.podgroup = gang.podgroup(job, seen.planned, namespace, owner)
        acts.events.append(Event(NORMAL, "CreatedPods", _created_message(acts.create, seen)))
    # A world made again under its number (resumed, or of an edited spec) finds the old one's
    # pods still terminating under the same names: they are not this world's pods.
    present = [
        p
        for p in seen.planned
        if (pod := seen.by_name.get(p["metadata"]["name"])) is not None and not st.deleting(pod)
    ]
    if len(present) + len(acts.create) == len(seen.planned) and not st.is_true(
        seen.old, st.CREATED
    ):
        message = f"the Service and {len(seen.planned)} pods of restart {seen.restart} exist"
        acts.status["conditions"] = created_conditions(
            acts.status, True, "PodsCreated", message, seen.now
        )


def _running(seen: Observed) -> int:
    """How many pods of the world run. Workers leave rpc.shutdown() and exit 0 a moment before
    the master: that is the world finishing, not pods going missing."""
    master = seen.master
    return sum(
        1
        for p in seen.current
        if not st.deleting(p)
        and (st.pod_phase(p) == "Running" or (st.pod_phase(p) == "Succeeded" and p is not master))
    )


def _starting_phase(
    seen: Observed, acts: Actions, running: int, queued: str | None, waiting: str | None
) -> Actions:
    """Running once every pod runs; else queued by a gang scheduler, restarting (the
    Restarting condition keeps saying what broke the old world until the new one runs), or
    pending (`waiting`: for the master's check)."""
    old, now, planned = seen.old, seen.now, len(seen.planned)
    if running == planned:
        message = f"all {running} pods are running"
        return transition(acts, old, st.RUNNING, "AllPodsRunning", message, now)
    if queued is not None:
        return transition(acts, old, st.QUEUED, "WaitingForAdmission", queued, now)
    if old.get("phase") == st.RESTARTING:
        cause = st.condition(old, st.RESTARTING) or {}
        reason = cause.get("reason") or "Restarting"
        message = cause.get("message") or f"restart {seen.restart}"
        return transition(acts, old, st.RESTARTING, reason, message, now)
    return _pending(
        seen, acts, "; ".join(filter(None, (f"{running}/{planned} pods running", waiting)))
    )


def _pending(seen: Observed, acts: Actions, message: str) -> Actions:
    """Pending; a pod that cannot start (a bad image, a missing secret) is said in the Running
    condition and a Warning, once."""
    old, now = seen.old, seen.now
    stuck = [(p["metadata"]["name"], w) for p in seen.current if (w := st.waiting_message(p))]
    if not stuck:
        return transition(acts, old, st.PENDING, "PodsPending", message, now)
    why = f"pod {stuck[0][0]} cannot start: {stuck[0][1]}"
    acts = transition(acts, old, st.PENDING, "PodsPending", f"{message}; {why}", now)
    acts.status["conditions"] = st.set_condition(
        list(acts.status["conditions"]), st.RUNNING, False, "PodCannotStart", why, now
    )
    if (st.condition(old, st.RUNNING) or {}).get("message") != why:
        acts.events.append(Event(WARNING, "PodCannotStart", why))
    return acts


def _keep_standby(seen: Observed, acts: Actions, running: bool) -> None:
    """The standby pods beside the world (elastic_world.standby_changes): made, and gone."""
    make, stale = elastic_world.standby_changes(
        seen.job,
        seen.size,
        seen.restart,
        seen.standby,
        running,
        seen.namespace,
        seen.owner,
        seen.image,
    )
    acts.create += make
    acts.delete += stale
    if gang.provider(seen.job) == sch.KUEUE:  # their groups end: Kueue frees their quota
        acts.end_group += [p for p in stale if not _ended(p)]


def _ended(pod: KubeObject) -> bool:
    return (pod["metadata"].get("annotations") or {}).get(sch.KUEUE_RETRIABLE) == "false"


def _unfinished(pods: list[KubeObject]) -> list[KubeObject]:
    """The pods still running or waiting to: those that stop when the job ends."""
    return [p for p in pods if not st.terminated(p)]


def _seconds(seconds: int) -> timedelta:
    return timedelta(seconds=seconds)


def _retry_invalid(old: JobStatus, meta: KubeObject) -> bool:
    """A job that failed on an invalid spec is looked at again once its spec is edited."""
    failed = st.condition(old, st.FAILED) or {}
    edited = meta.get("generation") != old.get("observedGeneration")
    return old.get("phase") == st.FAILED and failed.get("reason") == "InvalidSpec" and edited


def _created_message(pods: list[KubeObject], seen: Observed) -> str:
    names = ", ".join(p["metadata"]["name"] for p in pods)
    return f"created pods {names}" + (f" (restart {seen.restart})" if seen.restart else "")
