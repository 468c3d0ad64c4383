"""An elastic world on the emulated cluster, end to end: the unmodified operator, the real CRDs,
and the process-kubelet running real trainers on a node with room for a given number of CPUs.
A 2-replica PipelineJob loses a pod of replica 1 to an eviction while the node shrinks; its
new world's replica 1 cannot be placed, and after elastic.pendingSeconds the world goes on
with 1 replica from its checkpoint; when the room comes back, the standby pods run, and at
the next checkpoint the world is 2 replicas again, and succeeds. The Events tell the story."""

from __future__ import annotations

import re

import pytest

from harness import jobs
from harness.client import Api
from harness.kubelet import Kubelet

pytestmark = pytest.mark.timeout(400)

NS = "default"
KIND = "PipelineJob"
PENDING = 5  # elastic.pendingSeconds


def status(api: Api, name: str) -> dict:
    return (jobs.get(api, KIND, name) or {}).get("status") or {}


def events(api: Api) -> list[tuple[str, str]]:
    found = sorted(api.list("v1/events", NS), key=lambda e: int(e["metadata"]["resourceVersion"]))
    return [(e["reason"], e["message"]) for e in found]


def master_log(kubelet: Kubelet, name: str, world: int) -> str:
    """The log of world `world`'s master (the pods of every world share its name)."""
    runs = [r for r in kubelet.runs(NS) if r.name == f"{name}-master-0"
            and r.pod["metadata"]["labels"].get("pipejob.dev/restart") == str(world)]  # fmt: skip
    return "".join(r.log.read_text(errors="replace") for r in runs if r.log.exists())


def test_a_world_shrinks_when_a_replica_cannot_be_placed_and_grows_back_when_it_can(
    cluster, kubelet: Kubelet, operator, tmp_path
):
    api = cluster.api
    kubelet.capacity = {"cpu": "5"}  # the master and 2 x 2 stages, a CPU each
    ckpt = tmp_path / "checkpoints"  # the process-kubelet's pods share the host
    spec = {
        "model": {"transformer": {"vocabSize": 64, "layers": 4, "width": 32, "heads": 2,
                                  "seqLen": 16}},
        "stages": 2, "replicas": {"min": 1, "max": 2}, "batchSize": 4, "microBatches": 2,
        "steps": 120, "logEvery": 1, "backoffLimit": 0, "preflight": {"megabytes": 0.25},
        "elastic": {"pendingSeconds": PENDING},
        "checkpoint": {"path": str(ckpt), "everySteps": 4, "volume": "ckpt"},
        "template": {"resources": {"requests": {"cpu": "1"}},
                     "volumes": [{"name": "ckpt", "hostPath": {"path": str(ckpt),
                                                               "type": "DirectoryOrCreate"}}]},
    }  # fmt: skip
    name = jobs.create(api, jobs.example("resnet50-pipeline.yaml", **spec))["metadata"]["name"]
    api.wait("step 6 of the first world", lambda: "step 6/120" in master_log(kubelet, name, 0),
             180)  # fmt: skip
    assert status(api, name)["replicas"] == 2

    # The node loses two CPUs, and a stage of replica 1 with them.
    kubelet.capacity = {"cpu": "3"}
    kubelet.evict(NS, f"{name}-r1-stage-1", "The node was low on cpu.")
    api.wait("a world of 1 replica", lambda: status(api, name).get("replicas") == 1, 90)
    shrunk = status(api, name)
    assert (shrunk["restarts"], shrunk["preemptions"], shrunk["resizes"]) == (0, 1, 1)
    said = dict(events(api))
    assert said["ScaledDown"] == ("scaled from 2 to 1 replicas: 2 pods Pending: Unschedulable:"
                                  " 0/1 nodes are available: 1 Insufficient cpu.")  # fmt: skip
    resized = next(c for c in shrunk["conditions"] if c["type"] == "Resized")
    assert resized["reason"] == "ScaledDown" and resized["message"] == said["ScaledDown"]
    world = shrunk["restarts"] + shrunk["preemptions"] + shrunk["resizes"]
    api.wait("the 1-replica world to train on from its checkpoint",
             lambda: re.search(r"resumed from step (\d+)", master_log(kubelet, name, world)),
             120)  # fmt: skip
    log = master_log(kubelet, name, world)
    assert "1 replica(s) of the pipeline (replicas 1 to 2)" in log, log

    # The room comes back: the standby pods run, and the next checkpoint grows the world.
    api.wait("standby pods waiting for room", lambda: len(standby(api, name)) == 2, 60)
    assert all(p["status"].get("phase") == "Pending" for p in standby(api, name))
    kubelet.capacity = {"cpu": "5"}
    api.wait("a world of 2 replicas again", lambda: status(api, name).get("replicas") == 2, 120)
    assert dict(events(api))["ScaledUp"].startswith("scaled from 1 to 2 replicas: 2 standby"
                                                    " pods run (capacity returned); resuming"
                                                    " from the checkpoint of step")  # fmt: skip
    done = jobs.wait_phase(api, KIND, name, "Succeeded", timeout=240)["status"]
    assert (done["restarts"], done["preemptions"], done["resizes"], done["replicas"]) == (
        0, 1, 2, 2)  # fmt: skip
    last = master_log(kubelet, name, world + 1)
    assert re.search(r"resumed from step \d+", last) and "2 replica(s)" in last, last
    story = [
        reason
        for reason, _ in events(api)
        if reason in ("Preempted", "ScaledDown", "ScaledUp", "MasterSucceeded")
    ]
    assert story == ["Preempted", "ScaledDown", "ScaledUp", "MasterSucceeded"], events(api)
    assert standby(api, name) == []


def standby(api: Api, name: str) -> list[dict]:
    return [p for p in jobs.pods(api, name) if "pipejob.dev/standby" in p["metadata"]["labels"]
            and not p["metadata"].get("deletionTimestamp")]  # fmt: skip
