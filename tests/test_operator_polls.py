"""The polls of running masters' /progress (issue 60, operator/poll_schedule.py). At 5,000
running masters each poll was a reconcile (a GET of the job, a LIST of its pods) queued behind
every other, so a PipelineJob's stage pods, made once a poll finds its master checked, waited
13.4 s (p50) for it. Now a master whose world waits on it is polled first and soon, and a poll
whose report is unchanged costs no API call. The schedule alone with a clock of its own, then
the reconciler in process against the suite's API server and a real HTTP stand-in master."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import config
from test_metrics import master, report  # noqa: F401 (the fixture)

from harness import jobs
from harness.cluster import Cluster
from harness.standin import StandInMaster
from pipejob.operator import poll_schedule
from pipejob.operator.cluster import Cluster as Kube
from pipejob.operator.controller import PROGRESS_ENV, Key, Reconciler
from pipejob.operator.operator_metrics import OperatorMetrics
from pipejob.operator.poll_schedule import ALONE_FIRST, PollSchedule

pytestmark = pytest.mark.timeout(90)
REPO = Path(__file__).resolve().parents[1]
NS = "default"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lone_master_goes_before_due_routine_polls_and_the_routine_interval_keeps_a_budget(
    monkeypatch,
) -> None:
    monkeypatch.setattr(poll_schedule.random, "uniform", lambda a, b: b)  # due a whole interval on
    clock = Clock()
    schedule = PollSchedule(3.0, budget=10.0, clock=clock)
    for i in range(50):
        schedule.saw(f"r{i}", "http://r/progress", f"u{i}", alone=False)
    assert schedule.routine_interval() == 5.0  # 50 masters at 10 polls/s, not every 3 s
    schedule.saw("lone", "http://l/progress", "ul", alone=True)
    clock.now += 10  # every routine poll is overdue, and the lone master's first
    first = schedule.take(0)
    assert first is not None and first.key == "lone" and first.alone
    assert schedule.take(0).key == "r0"  # then the routine ones, in the order they fell due
    due, waits = first, []
    for _ in range(10):  # still checking: polled a little later each time, at most every 3 s
        schedule.polled(due)
        waits.append(schedule._entries["lone"].due - clock.now)
        clock.now += 10
        due = schedule.take(0)
        assert due.key == "lone"  # ahead of the 49 routine polls overdue
    assert waits == sorted(waits) and waits[0] == pytest.approx(1.5 * ALONE_FIRST)
    assert waits[-1] == pytest.approx(3.0)
    schedule.saw("lone", "http://l/progress", "ul", alone=False)  # its world is whole now
    assert schedule.alone() == 0 and schedule.routine_interval() == 51 / 10
    schedule.saw("lone", None, "", alone=False)  # its master went
    assert len(schedule) == 50 and "lone" not in schedule.keys()


class Counted(Kube):
    """The operator's API calls, each one counted on its way out."""

    calls: list[tuple[str, str]]

    def _call(self, method: str, path: str, *args, **kwargs) -> dict:
        self.calls.append((method, path))
        return super()._call(method, path, *args, **kwargs)


class Recording(Reconciler):
    """The reconciler, noting the job of each poll, in order."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.polled: list[Key] = []

    def poll(self, due) -> None:
        self.polled.append(due.key)
        super().poll(due)


def manifest(name: str, kind: str) -> dict:
    spec = {"steps": 5, "stages": 2} if kind == "PipelineJob" else {"steps": 5, "trainers": 1}
    return {"apiVersion": "pipejob.dev/v1alpha1", "kind": kind, "metadata": {"name": name}} | {
        "spec": spec
    }


def run_pods(c: Cluster, ip: str) -> None:
    """Every pod Running at `ip`, as a kubelet would say (the stand-in master answers there)."""
    running = {"name": "trainer", "state": {"running": {"startedAt": "2030-01-01T00:00:00Z"}}}
    for pod in c.api.list("v1/pods", NS):
        status = {"phase": "Running", "podIP": ip, "containerStatuses": [running]}
        c.api.patch("v1/pods", pod["metadata"]["name"], {"status": status}, NS, "status")


@pytest.fixture
def operator(tmp_path, monkeypatch) -> Iterator[tuple[Cluster, Recording]]:
    """The suite's API server and a reconciler of it (not started), polling every 0.2 s."""
    monkeypatch.setenv(PROGRESS_ENV, "0.2")
    with Cluster(tmp_path) as c:
        for path in sorted((REPO / "crds").glob("*.yaml")):
            jobs.apply_crd(c.api, yaml.safe_load(path.read_text()))
        kube = Counted(config.new_client_from_config(str(c.kubeconfig)))
        kube.calls = []
        reconciler = Recording(kube, "img", OperatorMetrics())
        yield c, reconciler
        reconciler.stop()


def make(c: Cluster, reconciler: Reconciler, name: str, kind: str) -> Key:
    jobs.create(c.api, manifest(name, kind), NS)
    key = (jobs.resource(kind).rsplit("/", 1)[1], NS, name)
    reconciler.track(key)
    reconciler.kick(key)
    return key


def test_a_lone_master_is_polled_before_a_queue_of_routine_polls(
    operator,
    master: StandInMaster,  # noqa: F811
    monkeypatch,
) -> None:
    c, reconciler = operator
    monkeypatch.setattr(poll_schedule.random, "uniform", lambda a, b: 0.0)  # due at once
    master.answer(report(1))  # past its check
    routine = [make(c, reconciler, f"h{i}", "HybridJob") for i in range(12)]
    run_pods(c, master.host)
    for key in routine:
        reconciler.kick(key)  # their worlds whole and running: routine polls, all due now
    lone = make(c, reconciler, "p", "PipelineJob")
    run_pods(c, master.host)
    reconciler.kick(lone)  # its master runs alone, its stages waiting on its check
    assert reconciler.polls.alone() == 1 and len(reconciler.polls) == 13
    time.sleep(ALONE_FIRST + 0.1)  # its first poll due too, after the 12 routine ones
    due = reconciler.polls.take(timeout=10)
    assert due is not None and due.key == lone, due  # 12 routine polls overdue before it
    reconciler.poll(due)
    assert sorted(p["metadata"]["name"] for p in jobs.pods(c.api, "p", NS)) == [
        "p-master-0",
        "p-stage-0",
        "p-stage-1",
    ]


def test_a_routine_poll_with_an_unchanged_report_makes_no_api_call(
    operator,
    master: StandInMaster,  # noqa: F811
) -> None:
    c, reconciler = operator
    master.answer(report(1))
    key = make(c, reconciler, "p", "PipelineJob")
    run_pods(c, master.host)
    reconciler.start(workers=1, pollers=1)
    reconciler.kick(key)  # as its pod's event would: the master runs alone, polled soon
    deadline = time.monotonic() + 30
    while len(jobs.pods(c.api, "p", NS)) < 3:  # its stages, once a poll found it checked
        assert time.monotonic() < deadline, reconciler.polled
        time.sleep(0.05)
    run_pods(c, master.host)
    reconciler.kick(key)  # the world whole: routine polls
    assert reconciler.queue.drained(20)
    polls, reconciler.cluster.calls[:] = master.polls, []
    while master.polls < polls + 5:  # five polls of the same report
        assert time.monotonic() < deadline + 30
        time.sleep(0.05)
    assert reconciler.cluster.calls == []  # no GET of the job, no LIST of its pods, no PATCH
    master.answer(report(2))  # a step further: a reconcile, and the status says so
    while jobs.get(c.api, "PipelineJob", "p").get("status", {}).get("progress") != "2/5":
        assert time.monotonic() < deadline + 60
        time.sleep(0.05)
    assert ("GET", f"/apis/pipejob.dev/v1alpha1/namespaces/{NS}/pipelinejobs/p") in (
        reconciler.cluster.calls
    )
