"""The operator's Prometheus metrics (operator_metrics.py): what they count, that /metrics parses,
and the unmodified operator against the API server emulator polling a stand-in master's
/progress into the job's status while counting the job in its metrics."""

from __future__ import annotations

import copy
import random
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import jobs
from harness.standin import StandInMaster
from pipejob.core.spec import parse
from pipejob.operator import kube
from pipejob.operator import status as st
from pipejob.operator.controller import Reconciler
from pipejob.operator.operator_metrics import OperatorMetrics

pytestmark = pytest.mark.timeout(60)

NS = "default"
PIPE, HYBRID = "PipelineJob", "HybridJob"
FAMILIES = {
    "pipejob_operator_jobs_created": "counter",
    "pipejob_operator_jobs_succeeded": "counter",
    "pipejob_operator_jobs_failed": "counter",
    "pipejob_operator_jobs_restarted": "counter",
    "pipejob_operator_jobs": "gauge",
    "pipejob_operator_reconcile_duration_seconds": "histogram",
    "pipejob_operator_progress_poll_duration_seconds": "histogram",
}


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of a /metrics page, checking every family's type."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name in FAMILIES:
            assert family.type == FAMILIES[family.name], family.name
        for s in family.samples:
            out[s.name, frozenset(s.labels.items())] = s.value
    return out


def value(page: dict, name: str, **labels: str) -> float:
    return page[name, frozenset(labels.items())]


def test_counters_follow_the_status_transitions_the_operator_writes():
    m = OperatorMetrics()
    life = [
        {},
        {"phase": st.PENDING, "restarts": 0},
        {"phase": st.RUNNING, "restarts": 0},
        {"phase": st.RESTARTING, "restarts": 1},
        {"phase": st.RESTARTING, "restarts": 1},
        {"phase": st.RUNNING, "restarts": 1},
        {"phase": st.SUCCEEDED, "restarts": 1},
        {"phase": st.SUCCEEDED, "restarts": 1},
    ]
    for old, new in zip(life, life[1:], strict=False):
        m.observe("a", PIPE, old, new)
    m.observe("b", HYBRID, {}, {"phase": st.FAILED})  # e.g. InvalidSpec at once
    m.observe("c", HYBRID, {}, {"phase": st.RUNNING, "restarts": 0})
    m.observe("c", HYBRID, {"phase": st.RUNNING}, {"phase": st.RESTARTING, "restarts": 1})
    m.observe(
        "c", HYBRID, {"phase": st.RESTARTING, "restarts": 1}, {"phase": st.FAILED, "restarts": 1}
    )
    get = m.registry.get_sample_value
    assert get("pipejob_operator_jobs_created_total", {"kind": PIPE}) == 1
    assert get("pipejob_operator_jobs_created_total", {"kind": HYBRID}) == 2
    assert get("pipejob_operator_jobs_succeeded_total", {"kind": PIPE}) == 1
    assert get("pipejob_operator_jobs_succeeded_total", {"kind": HYBRID}) == 0
    assert get("pipejob_operator_jobs_failed_total", {"kind": HYBRID}) == 2
    assert get("pipejob_operator_jobs_restarted_total", {"kind": PIPE}) == 1
    assert get("pipejob_operator_jobs_restarted_total", {"kind": HYBRID}) == 1
    assert m.phases()[PIPE, st.SUCCEEDED] == 1 and m.phases()[HYBRID, st.FAILED] == 2
    m.forget("a")
    assert m.phases()[PIPE, st.SUCCEEDED] == 0
    assert get("pipejob_operator_jobs_succeeded_total", {"kind": PIPE}) == 1  # counters stay


def test_metrics_are_served_and_parse_with_every_family():
    m = OperatorMetrics()
    m.observe("a", PIPE, {}, {"phase": st.RUNNING})
    m.reconcile_seconds.labels(PIPE).observe(0.02)
    server = m.serve(0, "127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    page = samples(text)
    assert {f.name for f in text_string_to_metric_families(text)} >= set(FAMILIES)
    assert value(page, "pipejob_operator_jobs", kind=PIPE, phase=st.RUNNING) == 1
    assert value(page, "pipejob_operator_jobs", kind=HYBRID, phase=st.RUNNING) == 0
    assert value(page, "pipejob_operator_jobs_created_total", kind=PIPE) == 1
    assert value(page, "pipejob_operator_reconcile_duration_seconds_count", kind=PIPE) == 1


def test_a_taken_port_is_a_clear_error():
    m = OperatorMetrics()
    server = m.serve(0, "127.0.0.1")
    port = server.server_port
    try:
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            OperatorMetrics().serve(port, "127.0.0.1")
    finally:
        server.shutdown()
        server.server_close()


# --- the operator, a stand-in master ------------------------------------------------------


@pytest.fixture
def master() -> Iterator[StandInMaster]:
    """A stand-in master on its own loopback address (the pod's IP) at the monitor port."""
    for _ in range(20):
        ip = f"127.{random.randint(200, 250)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
        try:
            standin = StandInMaster(ip, kube.PORTS.monitor)
            break
        except OSError:  # taken by another test run: another address
            continue
    else:
        pytest.fail("no free loopback address for the stand-in master")
    yield standin
    standin.close()


def report(step: int, steps: int = 5, **more) -> dict:
    return {
        "phase": "training",
        "step": step,
        "steps": steps,
        "loss": 2.0 / (step + 1),
        "samplesPerSecond": 10.0,
        "bubble": 0.4,
        "resumedFromStep": None,
        "preflight": {"ok": True, "message": "2 links ok"},
        "message": None,
        **more,
    }


def set_pod(api, name: str, status: dict) -> None:
    api.patch("v1/pods", name, {"status": status}, NS, subresource="status")


def test_the_operator_polls_progress_into_status_and_counts_the_job(cluster, operator, master):
    api = cluster.api
    manifest = {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": PIPE,
        "metadata": {"name": "pj"},
        "spec": {"model": "resnet18", "stages": 2, "steps": 5},
    }
    jobs.create(api, manifest)
    # No gang scheduler: the master's pod first, the stages' once a poll finds it checked.
    jobs.wait_pods(api, "pj", ["pj-master-0"], timeout=20)
    master.answer(report(2))
    set_pod(api, "pj-master-0", {"phase": "Running", "podIP": master.host})
    jobs.wait_pods(api, "pj", ["pj-master-0", "pj-stage-0", "pj-stage-1"], timeout=20)
    for name in ("pj-stage-0", "pj-stage-1"):  # as the kubelet reports them, with their IPs
        set_pod(api, name, {"phase": "Running", "podIP": "127.0.0.9"})

    def progress() -> str | None:
        return (jobs.get(api, PIPE, "pj") or {}).get("status", {}).get("progress")

    api.wait("progress 2/5", lambda: progress() == "2/5", 20)
    # The spec names no engine: `kubectl get`'s Engine (status.engine) says auto until the
    # master reports the one it chose.
    assert jobs.get(api, PIPE, "pj")["status"]["engine"] == "auto"
    master.answer(report(4, engine="pipelining"))
    api.wait("progress 4/5", lambda: progress() == "4/5", 20)
    job = jobs.get(api, PIPE, "pj")
    training = job["status"]["training"]
    assert (training["step"], training["loss"], training["bubble"]) == (4, 0.4, 0.4)
    assert training["engine"] == job["status"]["engine"] == "pipelining"
    preflight = next(c for c in job["status"]["conditions"] if c["type"] == st.PREFLIGHT)
    assert (preflight["status"], preflight["message"]) == ("True", "2 links ok")

    set_pod(
        api,
        "pj-master-0",
        {
            "phase": "Succeeded",
            "containerStatuses": [
                {"name": "trainer", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
            ],
        },
    )
    done = jobs.wait_phase(api, PIPE, "pj", "Succeeded", timeout=20)
    assert done["status"]["progress"] == "5/5"
    assert done["status"]["engine"] == "pipelining"  # the engine it ran on, kept

    def scraped() -> dict | None:
        page = samples(operator.get(operator.metrics_url).decode())
        return page if value(page, "pipejob_operator_jobs", kind=PIPE, phase="Succeeded") else None

    page = api.wait("the job counted as Succeeded", scraped, 10)
    assert value(page, "pipejob_operator_jobs_created_total", kind=PIPE) == 1
    assert value(page, "pipejob_operator_jobs_succeeded_total", kind=PIPE) == 1
    assert value(page, "pipejob_operator_jobs_failed_total", kind=PIPE) == 0
    assert value(page, "pipejob_operator_jobs", kind=PIPE, phase="Running") == 0
    assert value(page, "pipejob_operator_reconcile_duration_seconds_count", kind=PIPE) >= 3
    assert value(page, "pipejob_operator_progress_poll_duration_seconds_count", result="ok") >= 2
    assert master.polls >= 2


class Api:
    """The cluster as cluster.Cluster presents it, in memory: one job and its pods."""

    def __init__(self, job: dict, pods: list[dict]):
        self.job, self.pods, self.patches = job, pods, 0

    def get_job(self, plural: str, namespace: str, name: str) -> dict:
        return copy.deepcopy(self.job)

    def list_pods(self, namespace: str, job: str) -> list[dict]:
        return copy.deepcopy(self.pods)

    def patch_status(self, plural: str, job: dict, status: dict) -> None:
        self.patches += 1
        self.job["status"] = status

    def create(self, obj: dict) -> bool:
        return False

    def delete_pod(self, pod: dict) -> None:
        pass

    def post_event(self, *args) -> None:
        pass


def test_only_timer_reconciles_poll_and_each_is_measured(master):
    """A watch event's reconcile never polls: the status a poll writes is a watch event."""
    manifest = {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": PIPE,
        "metadata": {"name": "pj", "namespace": NS, "uid": "u", "generation": 1},
        "spec": {"stages": 2, "steps": 5},
    }
    pods = kube.world(parse(manifest), 0, NS, kube.owner_reference(manifest), "img")
    for i, pod in enumerate(pods):
        pod["metadata"]["uid"] = f"p{i}"
        pod["status"] = {"phase": "Running", "podIP": master.host if i == 0 else "127.0.0.9"}
    api, metrics = Api(manifest, pods), OperatorMetrics()
    reconciler = Reconciler(api, "img", metrics)
    key = ("pipelinejobs", NS, "pj")
    reconciler.track(key)
    master.answer(report(1))

    reconciler.kick(key)  # e.g. a pod event
    assert master.polls == 0 and "progress" not in api.job["status"]
    assert reconciler.training == {key}  # its master runs: the progress timer will poll it
    reconciler.kick(key, poll=True)
    assert master.polls == 1 and api.job["status"]["progress"] == "1/5"
    patches = api.patches
    reconciler.kick(key, poll=True)  # the same report: nothing to write
    assert master.polls == 2 and api.patches == patches
    get = metrics.registry.get_sample_value
    assert get("pipejob_operator_progress_poll_duration_seconds_count", {"result": "ok"}) == 2
    assert get("pipejob_operator_reconcile_duration_seconds_count", {"kind": PIPE}) == 3
    assert metrics.phases()[PIPE, st.RUNNING] == 1
