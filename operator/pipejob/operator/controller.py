"""The kopf wiring, thin on purpose: every trigger -- a job's watch event, an event of one of
its pods, a periodic resync -- queues the same reconcile of that job (workqueue.py), which a
worker thread runs: read the job and its pods, `reconcile.decide`, apply the actions. Nothing
is remembered between reconciles but the queue, a per-job lock and the running masters to
poll (poll_schedule.py), so a killed and restarted operator simply converges
again (docs/architecture.md)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from datetime import UTC, datetime
from typing import Any

import kopf

from pipejob.core import scheduling as sch
from pipejob.core import validate
from pipejob.core.contract import Progress
from pipejob.core.k8s import KubeObject
from pipejob.core.kinds import KINDS, by_plural
from pipejob.core.spec import API_VERSION, GROUP, VERSION
from pipejob.operator import (
    api_refusals,
    kube,
    policy_settings,
    poll_schedule,
    progress,
    reconcile,
    resync,
    status,
)
from pipejob.operator.cluster import LIST_CHUNK, ApiError, Cluster
from pipejob.operator.keyed_locks import KeyedLocks
from pipejob.operator.operator_metrics import OperatorMetrics
from pipejob.operator.poll_schedule import KEEP, Poll, PollSchedule
from pipejob.operator.workqueue import WorkQueue

RESYNC_ENV = "PIPEJOB_RESYNC_SECONDS"
DEFAULT_RESYNC = 10.0  # deadlines, TTLs and missed events are seen within this
PROGRESS_ENV = "PIPEJOB_PROGRESS_SECONDS"
DEFAULT_PROGRESS = 3.0  # how live status.progress is while a master runs; 0: never poll
POLLERS = 4  # threads polling masters' /progress (each poll waits up to progress.TIMEOUT)
# Reconciles side by side: each mostly waits on the API server, or on a master's /progress
# (up to progress.TIMEOUT), so a few more than kopf's default handler threads.
WORKERS = 8

REGISTRY = kopf.OperatorRegistry()
METRICS = OperatorMetrics()
# Our own logger, not kopf's per-object one: kopf would also post its records as Events,
# doubling the Events the reconcile posts itself.
log = logging.getLogger("pipejob.operator")

Key = tuple[str, str, str]  # (plural, namespace, name)


class Reconciler:
    """Runs reconciles, one at a time per job. kopf's handlers and the resync only queue a job
    (`enqueue`); `WORKERS` threads reconcile what is queued (`start`), each job once however
    many triggers named it (workqueue.py). `POLLERS` threads poll the running masters as
    `polls` schedules them, and reconcile a job only when its master's report changed."""

    def __init__(self, cluster: Cluster, image: str, metrics: OperatorMetrics = METRICS):
        self.cluster = cluster
        self.image = image
        self.metrics = metrics
        self.allow_node_volumes = validate.allowed_by_env(os.environ)
        self.policy = policy_settings.from_env()  # checked by `pipejob operator` at its start
        self.jobs: set[Key] = set()  # the jobs kopf has shown us, for the resync
        budget = _seconds(poll_schedule.BUDGET_ENV, poll_schedule.DEFAULT_BUDGET)
        self.polls = PollSchedule(progress_seconds(), budget)  # the running masters
        self.queue = WorkQueue()
        self._guard = threading.Lock()
        self._locks = KeyedLocks()

    def enqueue(self, key: Key, poll: bool = False, new: bool = False) -> None:
        """Have a worker reconcile the job (poll: and read its master's progress); a `new`
        job (none of our reconciles has written its status) ahead of the others."""
        self.queue.add(key, poll, new)

    @property
    def training(self) -> set[Key]:
        """The jobs whose master ran at their last reconcile: those polled."""
        return self.polls.keys()  # type: ignore[return-value]

    def start(self, workers: int = WORKERS, pollers: int = POLLERS) -> None:
        """Start the reconciles' workers, and the pollers unless polling is off."""
        for i in range(workers):
            threading.Thread(target=self._work, name=f"reconcile-{i}", daemon=True).start()
        for i in range(pollers if self.polls.interval > 0 else 0):
            threading.Thread(target=self._polls, name=f"poll-{i}", daemon=True).start()

    def stop(self) -> None:
        self.queue.close()
        self.polls.close()

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            key, poll = item
            try:
                self.kick(key, poll)
            except Exception as e:  # a trigger or the resync tries again; the operator goes on
                log.error(f"reconcile of {key[1]}/{key[2]} failed: {e}")
            finally:
                self.queue.done(key)

    def _polls(self) -> None:
        while (due := self.polls.take()) is not None:
            try:
                self.poll(due)
            except Exception as e:  # the next poll or a trigger tries again
                log.error(f"poll of {due.key[1]}/{due.key[2]} failed: {e}")
            finally:
                self.polls.polled(due)

    def poll(self, due: Poll) -> None:
        """Read a running master's /progress; reconcile its job (with that report) only if
        the report differs from the one its status shows: an unchanged one costs no API call."""
        report = self._fetch_progress(due.address)
        if report is not None and progress.digest(report) != due.shown:
            self.kick(due.key, report=(due.address, report))  # type: ignore[arg-type]

    def kick(
        self, key: Key, poll: bool = False, report: tuple[str, Progress] | None = None
    ) -> None:
        """Reconcile the job now, in this thread; with `poll`, read its master's progress;
        `report`: the one just read from that address (used if its master is still there)."""
        with self._locks.hold(key):
            started = time.perf_counter()
            try:
                self._reconcile(key, poll, report)
            finally:
                seconds = time.perf_counter() - started
                self.metrics.reconcile_seconds.labels(_kind_name(key[0])).observe(seconds)

    def track(self, key: Key) -> None:
        with self._guard:
            self.jobs.add(key)

    def forget(self, key: Key) -> None:
        with self._guard:
            self.jobs.discard(key)
        self.polls.forget(key)
        self.metrics.forget(key)

    def _fetch_progress(self, address: str) -> Progress | None:
        started = time.perf_counter()
        report = progress.fetch(address)
        result = "none" if report is None else "ok"
        self.metrics.poll_seconds.labels(result).observe(time.perf_counter() - started)
        return report

    def _reconcile(
        self, key: Key, poll: bool = False, report: tuple[str, Progress] | None = None
    ) -> None:
        plural, namespace, name = key
        job = self.cluster.get_job(plural, namespace, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            self.forget(key)  # garbage collection removes what it made
            return
        if sch.managed_elsewhere(job):  # MultiKueue's: it runs the job, and writes its status
            return
        pods = self.cluster.list_pods(namespace, name)
        world = status.world_number(job.get("status") or {})
        master = progress.master_of(pods, world) if key in self.jobs else None
        address = progress.address_of(master) if master is not None else None
        read = report[1] if report is not None and report[0] == address else None
        if read is None and poll and address is not None:
            read = self._fetch_progress(address)
        now = datetime.now(UTC)
        self._apply(key, job, self.decide(job, pods, now, read), now)
        shown = KEEP if read is None else progress.digest(read)
        uid = master["metadata"].get("uid", "") if master is not None else ""
        address = address if key in self.jobs else None  # deleted meanwhile: forgotten
        self.polls.saw(key, address, uid, progress.alone(pods, world), shown)

    def decide(
        self, job: KubeObject, pods: list[KubeObject], now: datetime, report: Progress | None = None
    ) -> reconcile.Actions:
        """`reconcile.decide` with this operator's image and settings."""
        return reconcile.decide(
            job, pods, now, self.image, report, self.allow_node_volumes, self.policy
        )

    def due(self) -> list[Key]:
        """The tracked jobs a resync reconciles: those a snapshot of the cluster shows it
        acting on, or gone (resync.py); all of them if the snapshot cannot be read. The
        running masters' progress is the pollers' (poll_schedule.py)."""
        with self._guard:
            keys = sorted(self.jobs)
        try:
            return resync.due(self.cluster, keys, self.decide)
        except Exception as e:  # the API server away, say: the reconciles will say more
            log.warning(f"resync: could not list the jobs and their pods, so each is read: {e}")
            return keys

    def _apply(self, key: Key, job: KubeObject, acts: reconcile.Actions, now: datetime) -> None:
        """Carry out `acts`. Pods before status (a world counts as created once its pods
        exist), status before deletes (a restart is recorded before its world goes), so a
        crash between any two steps is repaired by the next reconcile."""
        plural, namespace, name = key
        if acts.service is not None:
            self.cluster.create(acts.service)
        acts = self._apply_policy_and_podgroup(job, acts, now)
        for pod in acts.create:
            self.cluster.create(pod)
        old = job.get("status") or {}
        if acts.status != old:
            self.cluster.patch_status(plural, job, acts.status)
            if acts.status.get("phase") != old.get("phase"):
                log.info(f"{namespace}/{name}: {old.get('phase')} -> {acts.status['phase']}")
        self.metrics.observe(key, job.get("kind") or _kind_name(plural), old, acts.status)
        self._end_groups(key, acts.end_group)  # before the deletes: Kueue must see it on a pod
        for pod in acts.delete:
            self.cluster.delete_pod(pod)
        if acts.delete:
            names = ", ".join(p["metadata"]["name"] for p in acts.delete)
            log.info(f"{namespace}/{name}: deleted pods {names}")
        self._post_events(key, job, acts.events)
        if acts.delete_job:
            log.info(f"{namespace}/{name}: ttlSecondsAfterFinished passed: deleting the job")
            self.cluster.delete_job(plural, job)
            self.forget(key)

    def _apply_policy_and_podgroup(
        self, job: KubeObject, acts: reconcile.Actions, now: datetime
    ) -> reconcile.Actions:
        """The world's NetworkPolicy and PodGroup, before its pods: they must never run open,
        and a gang scheduler waits for its group. Refused (not allowed, no such kind, another's
        of that name): `acts` without pods, the status saying why."""
        for made, without in (
            (acts.policy, api_refusals.without_policy),
            (acts.podgroup, api_refusals.without_podgroup),
        ):
            if made is None or not acts.create:  # none, or the one before it was refused
                continue
            try:
                self.cluster.apply(made)
            except ApiError as e:
                if e.status not in (403, 404, 422):
                    raise
                acts = without(acts, job.get("status") or {}, str(e), now)
        return acts

    def _end_groups(self, key: Key, pods: list[KubeObject]) -> None:
        """End the Kueue pod groups of `pods`; not allowed, say what is left."""
        for pod in pods:
            try:
                self.cluster.end_kueue_group(pod)
            except ApiError as e:  # not allowed: the job is done anyway; say what is left
                if e.status != 403:
                    raise
                log.warning(
                    f"{key[1]}/{key[2]}: cannot end its Kueue pod group, which keeps"
                    f" its quota until its pods go (chart value"
                    f" scheduling.kueue.enabled): {e}"
                )

    def _post_events(self, key: Key, job: KubeObject, events: list[reconcile.Event]) -> None:
        """Log `events` and post them on the job; Events inform, they never stop a reconcile."""
        for event in events:
            level = logging.WARNING if event.type == reconcile.WARNING else logging.INFO
            log.log(level, f"{key[1]}/{key[2]}: {event.reason}: {event.message}")
            try:
                self.cluster.post_event(job, event.type, event.reason, event.message)
            except ApiError as e:
                log.warning(f"{key[1]}/{key[2]}: could not post an Event: {e}")


def _kind_name(plural: str) -> str:
    kind = by_plural(plural)
    return kind.name if kind else plural


def _seconds(env: str, default: float) -> float:
    value = os.environ.get(env)
    return float(value) if value else default


def resync_seconds() -> float:
    return _seconds(RESYNC_ENV, DEFAULT_RESYNC)


def progress_seconds() -> float:
    return _seconds(PROGRESS_ENV, DEFAULT_PROGRESS)


@kopf.on.login(registry=REGISTRY)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # Configures the `kubernetes` client (kubeconfig or the pod's service account) and hands
    # kopf the same credentials: one login for kopf's watches and our calls.
    return kopf.login_via_client(**kwargs)


@kopf.on.startup(registry=REGISTRY)
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Serve exactly the namespaces asked for; no CRD or Namespace watching (least privilege).
    settings.scanning.disabled = True
    settings.posting.level = logging.WARNING  # kopf's own Events: only its errors
    # Only the jobs' pods, listed in chunks: kopf keeps a record of every object it watches,
    # and a whole LIST of 5,000 jobs' pods would be the operator's largest allocation.
    settings.watching.label_selectors["v1", "pods"] = kube.JOB_LABEL
    settings.watching.chunk_size = LIST_CHUNK
    memo.reconciler = Reconciler(Cluster(), kube.trainer_image())
    memo.reconciler.start()
    memo.timers = [asyncio.create_task(_resync(memo.reconciler, resync_seconds()))]
    polls = memo.reconciler.polls
    log.info(
        f"trainer image {memo.reconciler.image}; resync every {resync_seconds()}s;"
        f" progress of running jobs every {progress_seconds() or 'never '}s"
        f" (at most {polls.budget:g} polls/s);"
        f" {policy_settings.describe(memo.reconciler.policy)}"
    )


@kopf.on.cleanup(registry=REGISTRY)
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    for task in getattr(memo, "timers", []):
        task.cancel()
    if getattr(memo, "reconciler", None) is not None:
        memo.reconciler.stop()


@kopf.on.probe(id="jobs", registry=REGISTRY)
def probe(memo: kopf.Memo, **_: Any) -> int:
    return len(memo.reconciler.jobs)


async def _resync(reconciler: Reconciler, interval: float) -> None:
    """Every job, every `interval`: deadlines, TTLs, missed events (and progress); only the
    jobs a snapshot shows needing it are read afresh (resync.py), and a round that took long
    is followed by a longer pause (resync.pause)."""
    took = 0.0
    while True:
        await asyncio.sleep(resync.pause(interval, took))
        started = time.monotonic()
        due = await asyncio.to_thread(reconciler.due)
        took = time.monotonic() - started
        for key in due:
            reconciler.enqueue(key, poll=True)


async def on_job(
    event: KubeObject, resource: Any, namespace: str, name: str, memo: kopf.Memo, **_: Any
) -> None:
    """A job was made, changed or went: queue its reconcile (on kopf's event loop: no
    handler thread waits on a reconcile)."""
    key = (resource.plural, namespace, name)
    if event.get("type") == "DELETED":
        memo.reconciler.forget(key)
        return
    memo.reconciler.track(key)
    memo.reconciler.enqueue(key, new=not (event.get("object") or {}).get("status"))


for _kind in KINDS.values():
    kopf.on.event(GROUP, VERSION, _kind.plural, id=_kind.plural, registry=REGISTRY)(on_job)


@kopf.on.event("v1", "pods", labels={kube.JOB_LABEL: kopf.PRESENT}, registry=REGISTRY)
async def on_pod(body: KubeObject, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """A pod of a job changed or went: reconcile the job that owns it."""
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("apiVersion") == API_VERSION:
            plural = KINDS[ref["kind"]].plural if ref.get("kind") in KINDS else ""
            key = (plural, namespace, ref["name"])
            if key in memo.reconciler.jobs:  # else the job's own event comes, or it is gone
                memo.reconciler.enqueue(key)


def run(
    namespaces: list[str],
    all_namespaces: bool,
    health: str | None,
    peering: str | None,
    metrics: tuple[str, int] | None = None,
) -> None:
    """Run the operator until interrupted (SIGINT/SIGTERM); serve /metrics on `metrics`
    (host, port) if given."""
    if metrics is not None:
        host, port = metrics
        METRICS.serve(port, host)
        log.info(f"metrics on http://{host}:{port}/metrics")
    kopf.run(
        registry=REGISTRY,
        clusterwide=all_namespaces,
        namespaces=namespaces,
        liveness_endpoint=health,
        standalone=peering is None,
        peering_name=peering,
        # kopf pauses every replica whose priority ties with a peer's: a random one per
        # replica makes exactly one active, and another takes over when it goes.
        priority=random.randint(1, 2**31 - 1) if peering else 0,
    )
