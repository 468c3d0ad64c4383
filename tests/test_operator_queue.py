"""The reconciles' queue (issue 60): a job is reconciled once for however many events named it,
and a job just created goes ahead of the jobs already running. Before it, kopf ran a reconcile
for every event in its handler threads, first come first served: a job created beside a
thousand others waited 12.5 minutes for its first reconcile behind their pods' events.
The queue alone, then kopf's handlers and the reconciler's workers in process against the
suite's API server."""

from __future__ import annotations

import asyncio
import threading
import types
from pathlib import Path

import pytest
import yaml
from kubernetes import config

from harness import jobs
from harness.cluster import Cluster
from pipejob.operator import controller
from pipejob.operator.cluster import Cluster as Kube
from pipejob.operator.controller import Key, Reconciler
from pipejob.operator.operator_metrics import OperatorMetrics
from pipejob.operator.workqueue import NEW_IN_A_ROW, WorkQueue

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[1]
NS = "default"


def test_a_job_named_many_times_is_queued_once_and_once_more_if_named_while_active() -> None:
    q = WorkQueue()
    q.add("a")
    q.add("b")
    q.add("a", poll=True)  # a timer's poll folds into the queued entry
    assert len(q) == 2
    assert q.get() == ("a", True)
    q.add("a")  # a's pods change while its reconcile runs: one more, after it
    q.add("a")
    assert q.get() == ("b", False)
    q.done("b")
    assert not q.drained(0)
    q.done("a")
    assert q.get() == ("a", False)
    q.done("a")
    assert q.drained(0) and len(q) == 0


def test_a_new_job_goes_ahead_of_the_queued_ones_and_close_wakes_the_workers() -> None:
    q = WorkQueue()
    for key in ("old1", "old2"):
        q.add(key)
    q.add("new", new=True)
    assert [q.get()[0] for _ in range(3)] == ["new", "old1", "old2"]
    got = []
    waiting = threading.Thread(target=lambda: got.append(q.get()))
    waiting.start()
    q.close()
    waiting.join(10)
    assert got == [None]


def test_a_long_burst_of_new_jobs_lets_one_waiting_job_through_every_few() -> None:
    """New jobs go first, but a burst of them cannot keep the running jobs' reconciles (their
    status updates) waiting until it ends."""
    q = WorkQueue()
    for key in ("r0", "r1", "r2"):
        q.add(key)
    for i in range(9):
        q.add(f"n{i}", new=True)
    order = [q.get()[0] for _ in range(12)]
    n = NEW_IN_A_ROW
    assert order[: n + 1] == [f"n{i}" for i in range(n)] + ["r0"]
    assert order.index("r1") == 2 * n + 1 and order.index("r2") > order.index("n8")


class Recording(Reconciler):
    """The reconciler, noting which job each reconcile was for, in order."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.order: list[Key] = []

    def _reconcile(self, key: Key, *args) -> None:
        self.order.append(key)
        super()._reconcile(key, *args)


def deliver(handler, **kwargs) -> None:
    """Call a kopf handler as kopf does, one event at a time."""
    result = handler(**kwargs)
    if asyncio.iscoroutine(result):
        asyncio.run(result)


def manifest(name: str, kind: str) -> dict:
    spec = {"steps": 3, "stages": 2} if kind == "PipelineJob" else {"steps": 3, "trainers": 1}
    return {"apiVersion": "pipejob.dev/v1alpha1", "kind": kind, "metadata": {"name": name}} | {
        "spec": spec
    }


def test_a_job_created_beside_busy_jobs_is_reconciled_first_and_they_once_each(tmp_path) -> None:
    with Cluster(tmp_path) as c:
        for path in sorted((REPO / "crds").glob("*.yaml")):
            jobs.apply_crd(c.api, yaml.safe_load(path.read_text()))
        kube = Kube(config.new_client_from_config(str(c.kubeconfig)))
        reconciler = Recording(kube, "img", OperatorMetrics())
        memo = types.SimpleNamespace(reconciler=reconciler)
        made = [manifest(f"j{i}", ("PipelineJob", "HybridJob")[i % 2]) for i in range(12)]
        made.append(manifest("new", "PipelineJob"))
        for m in made:
            jobs.create(c.api, m, NS)
        keys = [
            (jobs.resource(m["kind"]).rsplit("/", 1)[1], NS, m["metadata"]["name"]) for m in made
        ]
        for key in keys[:-1]:  # the busy jobs' worlds exist, their status written
            reconciler.track(key)
            reconciler.kick(key)
        reconciler.order.clear()

        # What kopf delivers after it LISTs again (a watch that expired): every pod, every
        # job; the new job's ADDED comes last.
        for pod in c.api.list("v1/pods", NS):
            deliver(controller.on_pod, body=pod, namespace=NS, memo=memo)
        for key, m in zip(keys, made, strict=True):
            job = jobs.get(c.api, m["kind"], key[2])
            event = {"type": "ADDED" if key == keys[-1] else None, "object": job}
            resource = types.SimpleNamespace(plural=key[0])
            deliver(
                controller.on_job,
                event=event,
                resource=resource,
                namespace=NS,
                name=key[2],
                memo=memo,
            )
        reconciler.start(2)
        assert reconciler.queue.drained(45), reconciler.order
        reconciler.stop()
        assert reconciler.order[0] == keys[-1], reconciler.order
        assert sorted(reconciler.order[1:]) == sorted(keys[:-1])  # one reconcile for all events
        assert jobs.pods(c.api, "new", NS)
