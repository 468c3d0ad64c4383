"""End to end, as close to a cluster as this machine gets: the unmodified operator, the real
CRDs, the API server emulator and the process-kubelet, which runs the operator's own pod specs
as real trainer processes (real torch RPC and DDP over per-pod loopback addresses and DNS).

The examples run with smaller sizes for CPU speed (fewer steps, tiny images); everything else
is the example as a user applies it."""

from __future__ import annotations

import re

import pytest

from harness import jobs
from harness.client import Api
from harness.kubelet import Kubelet

pytestmark = pytest.mark.timeout(240)

NS = "default"
# The examples, cut down for 2 CPU cores.
PIPELINE = (
    "resnet50-pipeline.yaml",
    {
        "stages": 2,
        "imageSize": 32,
        "batchSize": 4,
        "microBatches": 2,
        "numClasses": 10,
        "steps": 3,
        "logEvery": 1,
    },
)
HYBRID = ("hybrid.yaml", {"steps": 10, "datasetSize": 512, "logEvery": 1})


def start(api: Api, example: tuple[str, dict], **spec) -> dict:
    return jobs.create(api, jobs.example(example[0], **(example[1] | spec)))


def name_of(job: dict) -> str:
    return job["metadata"]["name"]


def wait_log(api: Api, kubelet: Kubelet, pod: str, text: str, timeout: float) -> None:
    api.wait(f"{text!r} in the log of {pod}", lambda: text in kubelet.logs(NS, pod), timeout)


def all_stopped(api: Api, kubelet: Kubelet) -> None:
    api.wait("every pod process to be gone", lambda: not kubelet.running(), 30)


def progress(api: Api, name: str) -> int:
    """The step the job's status reports (from the master's /progress), or -1."""
    job = jobs.get(api, "HybridJob", name) or {}
    reported = job.get("status", {}).get("progress", "")
    return int(reported.split("/")[0]) if "/" in reported else -1


def pod_uids(kubelet: Kubelet, job: str) -> list[str]:
    """Every pod of the job the node ever ran."""
    return [r.pod["metadata"]["uid"] for r in kubelet.runs(NS) if r.name.startswith(f"{job}-")]


# A HybridJob trains to success on this node in the DLRM test below (after a restart, too):
# the plain hybrid example is a `slow` variant.
@pytest.mark.parametrize(
    "example", [PIPELINE, pytest.param(HYBRID, marks=pytest.mark.slow)], ids=["pipeline", "hybrid"]
)
# slow: the pipelining replicas' restart trains to success; the hybrid ones in
# test_operator_faults_e2e.py
@pytest.mark.slow
def test_an_example_trains_to_success(cluster, kubelet, operator, example):
    api = cluster.api
    job = start(api, example)
    name, kind, steps = name_of(job), job["kind"], example[1]["steps"]
    done = jobs.wait_phase(api, kind, name, "Succeeded", timeout=180)
    assert done["status"]["restarts"] == 0, (done["status"], jobs.warnings(api))
    master = api.get("v1/pods", f"{name}-master-0", NS)
    assert master["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert f"step {steps}/{steps}" in kubelet.logs(NS, f"{name}-master-0")
    all_stopped(api, kubelet)  # the rest of the world is stopped, not left in rpc.shutdown


@pytest.mark.slow  # a killed stage's restart: the pipelining replicas' restart below holds it
def test_a_stage_killed_mid_run_restarts_the_world_which_then_succeeds(cluster, kubelet, operator):
    api = cluster.api
    name = name_of(start(api, PIPELINE, steps=8))
    wait_log(api, kubelet, f"{name}-master-0", "step 2/8", timeout=120)
    first_world = pod_uids(kubelet, name)
    kubelet.kill(NS, f"{name}-stage-1")  # as an OOM kill would
    done = jobs.wait_phase(api, "PipelineJob", name, "Succeeded", timeout=180)
    events = [e["message"] for e in api.list("v1/events", NS) if e["type"] == "Warning"]
    assert done["status"]["restarts"] == 1, (done["status"], events)  # why each restart
    second_world = [uid for uid in pod_uids(kubelet, name) if uid not in first_world]
    assert len(first_world) == len(second_world) == 3  # the whole world, once
    assert any(f"stage 1 (pod {name}-stage-1) failed with exit code 137" in m for m in events)
    all_stopped(api, kubelet)


@pytest.mark.slow  # a replicated world's restart: the pipelining test below holds it too
def test_a_killed_stage_of_replica_1_restarts_the_replicated_world(cluster, kubelet, operator):
    api = cluster.api
    name = name_of(start(api, PIPELINE, steps=6, replicas=2))
    wait_log(api, kubelet, f"{name}-master-0", "step 2/6", timeout=150)
    first_world = pod_uids(kubelet, name)
    assert len(first_world) == 5  # the master and 2 replicas of 2 stages
    kubelet.kill(NS, f"{name}-r1-stage-0")
    done = jobs.wait_phase(api, "PipelineJob", name, "Succeeded", timeout=200)
    events = [e["message"] for e in api.list("v1/events", NS) if e["type"] == "Warning"]
    assert done["status"]["restarts"] == 1, (done["status"], events)  # why each restart
    assert done["status"]["replicas"] == 2
    assert len([uid for uid in pod_uids(kubelet, name) if uid not in first_world]) == 5
    events = [e["message"] for e in api.list("v1/events", NS) if e["type"] == "Warning"]
    assert any(
        f"stage 0 of replica 1 (pod {name}-r1-stage-0) failed with exit code 137" in m
        for m in events
    ), events
    log = kubelet.logs(NS, f"{name}-master-0")
    assert "2 replicas (all-reduce" in log and "largest difference between replicas 0)" in log
    all_stopped(api, kubelet)


def test_a_job_whose_pods_always_fail_fails_after_the_backoff_limit(cluster, kubelet, operator):
    api = cluster.api
    # A broken image, as far as the process is concerned: its Python cannot even start.
    broken = {"template": {"env": [{"name": "PYTHONHOME", "value": "/nonexistent"}]}}
    name = name_of(start(api, HYBRID, backoffLimit=1, **broken))
    failed = jobs.wait_phase(api, "HybridJob", name, "Failed", timeout=120)
    assert failed["status"]["restarts"] == 1
    reason = next(c for c in failed["status"]["conditions"] if c["type"] == "Failed")
    assert reason["reason"] == "BackoffLimitExceeded"
    assert "failed with exit code 1" in reason["message"] and "backoffLimit 1" in reason["message"]
    worlds = {r.pod["metadata"]["labels"]["pipejob.dev/restart"] for r in kubelet.runs(NS)}
    assert worlds == {"0", "1"}  # the first world and its one restart ran, no more
    all_stopped(api, kubelet)


def test_deleting_a_running_job_leaves_no_pod_service_or_process(cluster, kubelet, operator):
    api = cluster.api
    name = name_of(start(api, HYBRID, steps=100000, logEvery=100))
    # Training, as the operator sees it: it reads the master's /progress in the pod network.
    api.wait("step 100 in the job's status.progress", lambda: progress(api, name) >= 100, 90)
    api.delete(jobs.resource("HybridJob"), name, NS)
    api.wait("no pods", lambda: jobs.pods(api, name) == [], 30)
    assert api.find("v1/services", name, NS) is None
    all_stopped(api, kubelet)


@pytest.mark.slow  # a restarted operator converges in test_operator_integration.py
def test_the_operator_killed_and_restarted_mid_job_makes_no_duplicates(cluster, kubelet, operator):
    api = cluster.api
    name = name_of(start(api, HYBRID, steps=150, logEvery=10))
    jobs.wait_phase(api, "HybridJob", name, "Running", timeout=60)
    world = pod_uids(kubelet, name)
    operator.kill()
    wait_log(api, kubelet, f"{name}-master-0", "step 10/150", timeout=60)  # training goes on
    operator.start()
    done = jobs.wait_phase(api, "HybridJob", name, "Succeeded", timeout=120)
    assert done["status"]["restarts"] == 0, (done["status"], jobs.warnings(api))
    assert pod_uids(kubelet, name) == world  # the same four pods, none made again
    all_stopped(api, kubelet)


# The pipelining example, cut down likewise: 1F1B over the stages' pipe group.
PIPELINING = (
    "resnet50-pipelining.yaml",
    {
        "model": "resnet18",
        "stages": 2,
        "imageSize": 32,
        "batchSize": 4,
        "microBatches": 2,
        "numClasses": 10,
        "logEvery": 1,
        "preflight": {"megabytes": 0.25},
    },
)


@pytest.mark.timeout(420)
def test_a_pipelining_job_with_replicas_restarts_and_resumes(cluster, kubelet, operator, tmp_path):
    """The pipelining engine on the cluster: its stage pods open the group port the plan
    gives them, and a stage of replica 1 killed after a checkpoint restarts the world, which
    resumes from it and succeeds."""
    api = cluster.api
    steps, every = 8, 2
    ckpt = tmp_path / "checkpoints"  # the process-kubelet mounts nothing: a shared directory
    spec = {
        "steps": steps,
        "replicas": 2,
        "backoffLimit": 2,
        "checkpoint": {"path": str(ckpt), "everySteps": every, "volume": "ckpt"},
        "template": {
            "volumes": [
                {"name": "ckpt", "hostPath": {"path": str(ckpt), "type": "DirectoryOrCreate"}}
            ]
        },
    }
    name = name_of(start(api, PIPELINING, **spec))
    master = f"{name}-master-0"
    stages = [f"{name}-r{r}-stage-{i}" for r in range(2) for i in range(2)]
    # The stages' pods come once the master has checked the model (master_check.py).
    for pod in jobs.wait_pods(api, name, [master, *stages], 120):
        if pod["metadata"]["name"] == master:
            continue
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert "ddp" in ports, ports  # the pipe group's rendezvous, from the world plan
    wait_log(api, kubelet, master, f"step {every + 1}/{steps}", timeout=240)
    kubelet.kill(NS, f"{name}-r1-stage-1")
    done = jobs.wait_phase(api, "PipelineJob", name, "Succeeded", timeout=300)
    assert done["status"]["restarts"] == 1, (done["status"], jobs.warnings(api))
    resumed = done["status"]["training"]["resumedFromStep"]
    assert resumed >= every and resumed % every == 0
    log = kubelet.logs(NS, master)
    assert f"resumed from step {resumed} (" in log and f"step {steps}/{steps}" in log
    assert (
        "on the pipelining engine (1f1b)" in log and "largest difference between replicas 0)" in log
    )


@pytest.mark.slow  # a killed server's restart: test_operator_faults_e2e.py's hybrid test holds it
@pytest.mark.timeout(400)
def test_the_dlrm_example_restarts_as_one_world_when_a_server_dies_and_resumes(
    cluster, kubelet, operator, tmp_path
):
    """The DLRM example on the cluster: five pods (master, 2 parameter servers, 2 trainers)
    wired as one world; a server killed mid-run restarts them all, and the new world loads
    every server's pieces from the last checkpoint, reaches the end, and the job's status
    shows the held-out AUC."""
    api = cluster.api
    data, ckpt = jobs.EXAMPLES / "dlrm", tmp_path / "ckpt"
    spec = {
        "steps": 30,
        "eval": {"everySteps": 10},
        "logEvery": 5,
        "backoffLimit": 2,
        "preflight": {"megabytes": 0.25},
        "output": {"path": str(tmp_path / "out")},
        "logging": {"tensorboard": str(tmp_path / "runs")},
        "data": {"criteo": {"train": str(data / "train.tsv"), "val": str(data / "val.tsv")}},
        "checkpoint": {"path": str(ckpt), "everySteps": 5, "volume": "ckpt"},
        "template": {
            "volumes": [
                {"name": "ckpt", "hostPath": {"path": str(ckpt), "type": "DirectoryOrCreate"}}
            ]
        },
    }
    name = name_of(jobs.create(api, jobs.example("dlrm/hybridjob.yaml", **spec)))
    master = f"{name}-master-0"
    pods = [master, f"{name}-ps-0", f"{name}-ps-1", f"{name}-trainer-0", f"{name}-trainer-1"]
    jobs.wait_pods(api, name, pods, 30)
    wait_log(api, kubelet, master, "step 15/30", timeout=200)
    first_world = pod_uids(kubelet, name)
    kubelet.kill(NS, f"{name}-ps-1")  # as an OOM kill would
    done = jobs.wait_phase(api, "HybridJob", name, "Succeeded", timeout=240)
    events = [e["message"] for e in api.list("v1/events", NS) if e["type"] == "Warning"]
    assert done["status"]["restarts"] == 1, (done["status"], events)
    assert len([uid for uid in pod_uids(kubelet, name) if uid not in first_world]) == 5
    training = done["status"]["training"]
    assert training["resumedFromStep"] >= 15 and training["resumedFromStep"] % 5 == 0
    assert training["evalStep"] == 30 and training["evalAuc"] > 0.6, training
    log = kubelet.logs(NS, master)
    assert f"resumed from step {training['resumedFromStep']}" in log
    assert re.search(r"eval step 30: loss [\d.]+, AUC [\d.]+ on 250 held-out samples", log), log
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 26 * 1000 * 8 * 4
    all_stopped(api, kubelet)
