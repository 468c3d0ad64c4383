"""An elastic world on the emulated cluster, end to end: the unmodified operator, the real CRDs,
and the process-kubelet running real trainers on a node with room for a given number of CPUs.
A 2-replica PipelineJob loses a pod of replica 1 to an eviction while the node shrinks; its
new world's replica 1 cannot be placed, and after elastic.pendingSeconds the world goes on
with 1 replica from its checkpoint; when the room comes back, the standby pods run, and at
the next checkpoint the world is 2 replicas again, and succeeds. The Events tell the story.
Under Kueue (tests/harness/kueue.py) the same world waits for quota instead, and each size is
a pod group Kueue admits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness import jobs
from harness.client import Api
from harness.kubelet import Kubelet
from harness.kueue import Kueue

TESTS = Path(__file__).parent  # holds userpkg/: on the pods' PYTHONPATH through the template

pytestmark = pytest.mark.timeout(400)

NS = "default"
KIND = "PipelineJob"
PENDING = 5  # elastic.pendingSeconds


def status(api: Api, name: str) -> dict:
    return (jobs.get(api, KIND, name) or {}).get("status") or {}


def events(api: Api) -> list[tuple[str, str]]:
    found = sorted(api.list("v1/events", NS), key=lambda e: int(e["metadata"]["resourceVersion"]))
    return [(e["reason"], e["message"]) for e in found]


def event(api: Api, reason: str) -> str:
    """The message of the Event `reason`, once posted (the operator posts Events after it
    writes the status)."""
    return api.wait(f"a {reason} Event", lambda: dict(events(api)).get(reason), 30)


def master_log(kubelet: Kubelet, name: str, world: int) -> str:
    """The log of world `world`'s master (the pods of every world share its name)."""
    runs = [
        r
        for r in kubelet.runs(NS)
        if r.name == f"{name}-master-0"
        and r.pod["metadata"]["labels"].get("pipejob.dev/restart") == str(world)
    ]
    return "".join(r.log.read_text(errors="replace") for r in runs if r.log.exists())


def elastic_spec(ckpt: Path, steps: int) -> dict:
    """A small 2-stage pipeline of 1 to 2 replicas, each pod asking for a CPU, checkpointing
    every 4 steps on a directory of the host (the process-kubelet's pods share it)."""
    return {
        "model": {
            "transformer": {"vocabSize": 64, "layers": 4, "width": 32, "heads": 2, "seqLen": 16}
        },
        "stages": 2,
        "replicas": {"min": 1, "max": 2},
        "batchSize": 4,
        "microBatches": 2,
        "steps": steps,
        "logEvery": 1,
        "backoffLimit": 0,
        "preflight": {"megabytes": 0.25},
        "elastic": {"pendingSeconds": PENDING},
        "checkpoint": {"path": str(ckpt), "everySteps": 4, "volume": "ckpt"},
        "template": {
            "resources": {"requests": {"cpu": "1"}},
            "volumes": [
                {"name": "ckpt", "hostPath": {"path": str(ckpt), "type": "DirectoryOrCreate"}}
            ],
        },
    }


def paced(spec: dict, seconds: float) -> dict:
    """`spec` with a model whose every micro-batch takes at least `seconds` on its last stage
    (tests/userpkg/paced.py): the shrunk world is still training when the room comes back,
    however fast the engine's steps are (at 26 ms a step, 120 steps ended before)."""
    template = {**spec["template"], "env": [{"name": "PYTHONPATH", "value": str(TESTS)}]}
    model = {"import": "userpkg.paced:cnn", "args": {"seconds": seconds}}
    return spec | {"model": model, "imageSize": 32, "numClasses": 10, "template": template}


def test_a_world_shrinks_when_a_replica_cannot_be_placed_and_grows_back_when_it_can(
    cluster, kubelet: Kubelet, operator, tmp_path
):
    api = cluster.api
    kubelet.capacity = {"cpu": "5"}  # the master and 2 x 2 stages, a CPU each
    spec = paced(elastic_spec(tmp_path / "checkpoints", steps=300), seconds=0.05)
    name = jobs.create(api, jobs.example("resnet50-pipeline.yaml", **spec))["metadata"]["name"]
    api.wait("step 6 of the first world", lambda: "step 6/300" in master_log(kubelet, name, 0), 180)
    assert status(api, name)["replicas"] == 2

    # The node loses two CPUs, and a stage of replica 1 with them.
    kubelet.capacity = {"cpu": "3"}
    kubelet.evict(NS, f"{name}-r1-stage-1", "The node was low on cpu.")
    api.wait("a world of 1 replica", lambda: status(api, name).get("replicas") == 1, 90)
    shrunk = status(api, name)
    assert (shrunk["restarts"], shrunk["preemptions"], shrunk["resizes"]) == (0, 1, 1)
    said = event(api, "ScaledDown")
    # Replica 1's two pods are found unschedulable one after the other: on a loaded machine
    # the first may pass pendingSeconds alone, and the message counts those that had.
    assert re.fullmatch(
        r"scaled from 2 to 1 replicas: [12] pods? Pending: Unschedulable: 0/1"
        r" nodes are available: 1 Insufficient cpu\.",
        said,
    ), said
    resized = next(c for c in shrunk["conditions"] if c["type"] == "Resized")
    assert resized["reason"] == "ScaledDown" and resized["message"] == said
    world = shrunk["restarts"] + shrunk["preemptions"] + shrunk["resizes"]
    api.wait(
        "the 1-replica world to train on from its checkpoint",
        lambda: re.search(r"resumed from step (\d+)", master_log(kubelet, name, world)),
        120,
    )
    log = master_log(kubelet, name, world)
    assert "1 replica(s) of the pipeline (replicas 1 to 2)" in log, log

    # The room comes back: the standby pods run, and the next checkpoint grows the world.
    api.wait("standby pods waiting for room", lambda: len(standby(api, name)) == 2, 60)
    assert all(p["status"].get("phase") == "Pending" for p in standby(api, name))
    kubelet.capacity = {"cpu": "5"}
    api.wait("a world of 2 replicas again", lambda: status(api, name).get("replicas") == 2, 120)
    assert event(api, "ScaledUp").startswith(
        "scaled from 1 to 2 replicas: 2 standby"
        " pods run (capacity returned); resuming"
        " from the checkpoint of step"
    )
    done = jobs.wait_phase(api, KIND, name, "Succeeded", timeout=240)["status"]
    assert (done["restarts"], done["preemptions"], done["resizes"], done["replicas"]) == (
        0,
        1,
        2,
        2,
    )
    last = master_log(kubelet, name, world + 1)
    assert re.search(r"resumed from step \d+", last) and "2 replica(s)" in last, last
    event(api, "MasterSucceeded")
    story = [
        reason
        for reason, _ in events(api)
        if reason in ("Preempted", "ScaledDown", "ScaledUp", "MasterSucceeded")
    ]
    assert story == ["Preempted", "ScaledDown", "ScaledUp", "MasterSucceeded"], events(api)
    assert standby(api, name) == []


def standby(api: Api, name: str) -> list[dict]:
    return [
        p
        for p in jobs.pods(api, name)
        if "pipejob.dev/standby" in p["metadata"]["labels"]
        and not p["metadata"].get("deletionTimestamp")
    ]


@pytest.mark.slow  # the shrink and regrowth below, Kueue's admission in test_scheduling_e2e.py
def test_kueue_admits_the_resized_group_and_then_the_regrown_one(
    cluster, kubelet: Kubelet, kueue: Kueue, operator, tmp_path
):
    """Kueue holds a 2-replica world back (its queue admits 3 pods at once): after
    pendingSeconds the world is a group of 3 pods, which Kueue admits (the first group, never
    admitted, holds no quota). With quota for more, the standby pods' own group is admitted,
    and at the next checkpoint the world is 2 replicas again, a group of 5; the group of 3,
    ended, lets its quota go."""
    api = cluster.api
    kueue.queues["team-a"] = 3
    ckpt = tmp_path / "checkpoints"
    spec = elastic_spec(ckpt, steps=60) | {"scheduling": {"provider": "kueue", "queue": "team-a"}}
    spec["template"].pop("resources")  # Kueue's quota is what limits here
    name = jobs.create(api, jobs.example("resnet50-pipeline.yaml", **spec))["metadata"]["name"]
    api.wait("a world of 1 replica", lambda: status(api, name).get("replicas") == 1, 90)
    assert event(api, "ScaledDown").startswith(
        f"scaled from 2 to 1 replicas: not admitted in {PENDING}s: Kueue has not admitted pod"
        f" group {name} (5 pods) from LocalQueue team-a yet"
    )
    first = kueue.workload(NS, name)
    assert first.total == 5 and first.admissions == 0 and not first.admitted  # holds no quota
    api.wait(
        "the 3-pod group to be admitted",
        lambda: (w := kueue.workload(NS, f"{name}-1")) and w.admissions == 1,
        90,
    )
    assert kueue.workload(NS, f"{name}-1").total == 3

    kueue.queues["team-a"] = None  # quota for everything: the standby group is admitted
    api.wait("a world of 2 replicas again", lambda: status(api, name).get("replicas") == 2, 180)
    done = jobs.wait_phase(api, KIND, name, "Succeeded", timeout=240)["status"]
    assert (done["restarts"], done["resizes"]) == (0, 2)
    assert (
        kueue.workload(NS, f"{name}-2").total == 5
        and kueue.workload(NS, f"{name}-2").admissions == 1
    )
    assert kueue.workload(NS, f"{name}-1").finished  # ended when the world grew
