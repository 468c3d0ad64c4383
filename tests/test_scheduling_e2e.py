"""Gang admission end to end on the emulated cluster: the unmodified operator, the real CRDs,
the process-kubelet running real trainers, and the harness playing each gang scheduler as its
documents say: Kueue's webhook, gate, finalizer, admission and preemption (harness/kueue.py);
Volcano's and the coscheduling plugin's PodGroups (harness/gang.py)."""

from __future__ import annotations

import re

import pytest

from harness import jobs
from harness.client import Api
from harness.kubelet import Kubelet
from harness.kueue import GATE, MANAGED, RETRIABLE, Kueue
from harness.variants import exhaustive

pytestmark = pytest.mark.timeout(300)

NS = "default"
KIND = "PipelineJob"
SMALL = {
    "model": "resnet18",
    "stages": 2,
    "imageSize": 32,
    "batchSize": 4,
    "microBatches": 2,
    "numClasses": 10,
    "logEvery": 1,
    "steps": 3,
    "preflight": {"megabytes": 0.25},
}
KUEUE = {"provider": "kueue", "queue": "team-a"}


def create(api: Api, **spec) -> str:
    job = jobs.create(api, jobs.example("resnet50-pipeline.yaml", **(SMALL | spec)))
    return job["metadata"]["name"]


def status(api: Api, name: str) -> dict:
    return (jobs.get(api, KIND, name) or {}).get("status") or {}


def condition(job: dict, kind: str) -> dict:
    return next(c for c in job["status"]["conditions"] if c["type"] == kind)


def events(api: Api, reason: str) -> list[str]:
    return [e["message"] for e in api.list("v1/events", NS) if e["reason"] == reason]


def runs_of(kubelet: Kubelet, name: str) -> list[str]:
    return [r.name for r in kubelet.runs(NS) if r.name.startswith(f"{name}-")]


def all_stopped(api: Api, kubelet: Kubelet) -> None:
    api.wait("every pod process to be gone", lambda: not kubelet.running(), 30)


@pytest.mark.slow  # the preempted job below is queued and admitted whole too
def test_a_kueue_job_waits_queued_is_admitted_whole_trains_and_its_group_succeeds(
    cluster, kubelet, kueue: Kueue, operator
):
    api = cluster.api
    kueue.queues["team-a"] = 0  # no quota yet
    name = create(api, scheduling=KUEUE)
    queued = jobs.wait_phase(api, KIND, name, "Queued", timeout=30)
    message = condition(queued, "Queued")["message"]
    assert "LocalQueue team-a" in message and "3/3 pods gated" in message, message
    pods = jobs.pods(api, name)
    assert sorted(p["metadata"]["name"] for p in pods) == [
        f"{name}-master-0-r0",
        f"{name}-stage-0-r0",
        f"{name}-stage-1-r0",
    ]
    for pod in pods:  # as Kueue's webhook left them
        assert pod["spec"]["schedulingGates"] == [{"name": GATE}]
        assert MANAGED in pod["metadata"]["finalizers"]
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"
        assert not pod["spec"].get("nodeName")
    assert runs_of(kubelet, name) == []  # nothing started

    kueue.queues["team-a"] = None  # quota: the group is admitted
    done = jobs.wait_phase(api, KIND, name, "Succeeded", timeout=180)
    assert done["status"]["restarts"] == 0 and not done["status"].get("preemptions")
    assert any(f"pod group {name} (3 pods)" in m for m in events(api, "Admitted"))
    workload = kueue.workload(NS, name)
    # Every pod the node ran was ungated by the group's one admission, none before.
    assert workload.admissions == 1 and sorted(runs_of(kubelet, name)) == sorted(workload.ungated)
    api.wait("the group to succeed", lambda: workload.finished and workload.succeeded, 60)
    api.wait("Kueue to let go of every pod", lambda: _finalized(api, name), 30)
    for pod in jobs.pods(api, name):  # every pod exited 0; Kueue let go of each
        assert pod["status"]["phase"] == "Succeeded", pod["metadata"]["name"]
        assert MANAGED not in (pod["metadata"].get("finalizers") or [])
        assert pod["spec"]["hostname"] == pod["metadata"]["name"].removesuffix("-r0")
    all_stopped(api, kubelet)


# slow: Kueue's gate and group in the tests below; restarts and resumes in test_operator_e2e.py
@pytest.mark.slow
def test_a_kueue_job_preempted_mid_run_is_requeued_and_resumes_from_its_checkpoint(
    cluster, kubelet, kueue: Kueue, operator, tmp_path
):
    api = cluster.api
    ckpt = tmp_path / "checkpoints"  # the process-kubelet's pods share the host
    spec = {
        "steps": 12,
        "backoffLimit": 0,
        "scheduling": KUEUE,
        "checkpoint": {"path": str(ckpt), "everySteps": 2, "volume": "ckpt"},
        "template": {
            "volumes": [
                {"name": "ckpt", "hostPath": {"path": str(ckpt), "type": "DirectoryOrCreate"}}
            ]
        },
    }
    name = create(api, **spec)
    master = f"{name}-master-0-r0"
    api.wait("step 5 in the master's log", lambda: "step 5/12" in kubelet.logs(NS, master), 150)

    kueue.queues["team-a"] = 0  # the quota went to a more important workload
    assert len(kueue.preempt(NS, name)) == 3
    requeued = jobs.wait_phase(api, KIND, name, "Queued", timeout=60)
    assert requeued["status"]["preemptions"] == 1 and requeued["status"]["restarts"] == 0
    (preempted,) = events(api, "Preempted")
    assert "was preempted (Preempted: Preempted to accommodate" in preempted, preempted
    assert "no backoffLimit spent" in preempted

    kueue.queues["team-a"] = None
    done = jobs.wait_phase(api, KIND, name, "Succeeded", timeout=180)
    # backoffLimit 0: had the preemption counted as a failure, the job would have failed.
    assert (done["status"]["restarts"], done["status"]["preemptions"]) == (0, 1)
    resumed = done["status"]["training"]["resumedFromStep"]
    assert resumed >= 2 and resumed % 2 == 0
    second = kubelet.logs(NS, f"{name}-master-0-r1")
    assert re.search(rf"resum\w* from (checkpoint at )?step {resumed}\b", second), second
    assert kueue.workload(NS, name).admissions == 2
    api.wait("the group to succeed", lambda: kueue.workload(NS, name).succeeded, 60)
    all_stopped(api, kubelet)


def test_a_failing_kueue_job_ends_its_group(cluster, kubelet, kueue: Kueue, operator):
    api = cluster.api
    broken = {"env": [{"name": "PYTHONHOME", "value": "/nonexistent"}]}
    name = create(api, scheduling=KUEUE, backoffLimit=0, template=broken)
    failed = jobs.wait_phase(api, KIND, name, "Failed", timeout=120)
    assert failed["status"]["restarts"] == 0
    workload = kueue.workload(NS, name)
    api.wait("Kueue to finish the group", lambda: workload.finished, 60)
    api.wait("Kueue to let go of every pod", lambda: _finalized(api, name), 30)
    assert not workload.succeeded
    # Kueue ends the group once one pod is so annotated; the operator patches the others in
    # the same reconcile, one request each, so the last ones may land a moment later.
    api.wait(
        "every pod annotated retriable-in-group=false",
        lambda: all(
            (p["metadata"].get("annotations") or {}).get(RETRIABLE) == "false"
            for p in jobs.pods(api, name)
        ),
        30,
    )
    for pod in jobs.pods(api, name):
        assert MANAGED not in (pod["metadata"].get("finalizers") or [])
    all_stopped(api, kubelet)


def test_a_kueue_group_is_not_admitted_before_all_its_pods_exist(cluster, kubelet, kueue):
    api = cluster.api
    pods = [
        _pod(
            f"p{i}",
            {"kueue.x-k8s.io/queue-name": "team-a", "kueue.x-k8s.io/pod-group-name": "g"},
            {"kueue.x-k8s.io/pod-group-total-count": "3"},
        )
        for i in range(3)
    ]
    for pod in pods[:2]:
        api.create("v1/pods", pod, NS)
    _stays_unbound(api, ["p0", "p1"])
    assert kueue.workload(NS, "g").admissions == 0
    api.create("v1/pods", pods[2], NS)
    _all_bound(api, ["p0", "p1", "p2"])


@pytest.mark.parametrize("flavour", ["volcano", "coscheduling"])
def test_a_podgroup_starts_only_whole(cluster, kubelet, flavour, request):
    scheduler = request.getfixturevalue(flavour)
    api = cluster.api
    podgroups = scheduler.flavour.podgroups
    api.create(
        podgroups,
        {
            "apiVersion": podgroups.rsplit("/", 1)[0],
            "kind": "PodGroup",
            "metadata": {"name": "g"},
            "spec": {"minMember": 3},
        },
        NS,
    )
    names = ["p0", "p1", "p2"]
    for name in names[:2]:
        pod = _pod(name, {}, {})
        pod["spec"]["schedulerName"] = scheduler.flavour.scheduler
        if scheduler.flavour.annotation:
            pod["metadata"]["annotations"][scheduler.flavour.annotation] = "g"
        else:
            pod["metadata"]["labels"][scheduler.flavour.label] = "g"
        api.create("v1/pods", pod, NS)
    _stays_unbound(api, names[:2])
    assert api.get(podgroups, "g", NS)["status"]["phase"] == "Pending"
    pod["metadata"]["name"] = names[2]
    api.create("v1/pods", pod, NS)
    _all_bound(api, names)
    assert scheduler.placements[(NS, "g")] == [names]  # in one round, all at once


# Volcano's PodGroup is a `slow` variant: the operator makes both the same way.
@pytest.mark.parametrize("flavour", exhaustive(["volcano", "coscheduling"], {"coscheduling"}))
def test_a_podgroup_job_trains_and_leaves_nothing_when_deleted(
    cluster, kubelet, operator, flavour, request
):
    scheduler = request.getfixturevalue(flavour)
    api = cluster.api
    scheduling = {"provider": flavour, **({"queue": "research"} if flavour == "volcano" else {})}
    resources = {"requests": {"cpu": "100m", "memory": "64Mi"}}
    name = create(api, scheduling=scheduling, steps=400, template={"resources": resources})
    world = [f"{name}-master-0", f"{name}-stage-0", f"{name}-stage-1"]
    api.wait("a step in the master's log", lambda: "step 1/400" in kubelet.logs(NS, world[0]), 150)
    job = jobs.get(api, KIND, name)
    group = api.get(scheduler.flavour.podgroups, name, NS)
    assert group["spec"]["minMember"] == 3
    assert group["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    if flavour == "volcano":
        assert group["spec"]["queue"] == "research"
        assert group["spec"]["minResources"] == {"cpu": "300m", "memory": str(3 * 64 * 2**20)}
    assert scheduler.placements[(NS, name)] == [world]  # the world started whole
    for pod in jobs.pods(api, name):
        assert pod["spec"]["schedulerName"] == scheduler.flavour.scheduler
        assert scheduler.flavour.group_of(pod) == name

    api.delete(jobs.resource(KIND), name, NS)
    api.wait("no pods", lambda: jobs.pods(api, name) == [], 30)
    assert api.find(scheduler.flavour.podgroups, name, NS) is None
    assert api.find("v1/services", name, NS) is None
    all_stopped(api, kubelet)


def _finalized(api: Api, name: str) -> bool:
    """Kueue removed its finalizer from every pod of the job (it does so once it finishes)."""
    return all(MANAGED not in (p["metadata"].get("finalizers") or []) for p in jobs.pods(api, name))


def _pod(name: str, labels: dict, annotations: dict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": dict(labels), "annotations": dict(annotations)},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "c", "image": "python", "command": ["python", "-c", "pass"]}],
        },
    }


def _bound(api: Api, name: str) -> bool:
    return bool(api.get("v1/pods", name, NS)["spec"].get("nodeName"))


def _stays_unbound(api: Api, names: list[str]) -> None:
    """Still unbound after the schedulers had many rounds to bind them."""
    try:
        api.wait("a pod to be bound", lambda: any(_bound(api, n) for n in names), 2)
    except TimeoutError:
        return
    raise AssertionError(f"a pod of {names} was bound before its whole group existed")


def _all_bound(api: Api, names: list[str]) -> None:
    api.wait(f"{names} bound", lambda: all(_bound(api, n) for n in names), 20)
