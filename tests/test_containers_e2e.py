"""End to end in containers: the unmodified operator and the API server emulator, with the
container-kubelet running the operator's pods as docker containers of the trainer image
built from this checkout, on a bridge network of the test's own. This is what users run:
the image's entry point, pod DNS from the headless Service, uid 10001 with every capability
dropped, volumes, termination messages.

Jobs are cut down for 2 CPU cores (tiny images, few steps)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness import jobs
from harness.client import Api
from harness.container_kubelet import ContainerKubelet
from harness.docker import cli
from pipejob.operator.policy_settings import POLICY_ENV

# The timeout bounds each test; the images fixture bounds its own build (scripts/images.sh).
pytestmark = pytest.mark.timeout(600, func_only=True)

NS = "default"
# ResNet-18, not the example's ResNet-50: a third of the work for what the containers prove.
PIPELINE = (
    "resnet50-pipeline.yaml",
    {
        "model": "resnet18",
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
CLAIM = "results"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom-model"


def claim(api: Api, name: str = CLAIM) -> dict:
    return api.create(
        "v1/persistentvolumeclaims",
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
        NS,
    )


def on_claim(mount: str = "/data", name: str = CLAIM) -> dict:
    """A job's template mounting the claim at `mount`."""
    return {
        "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": name}}],
        "volumeMounts": [{"name": "shared", "mountPath": mount}],
    }


def start(api: Api, example: tuple[str, dict], **spec) -> str:
    job = jobs.create(api, jobs.example(example[0], **(example[1] | spec)))
    return job["metadata"]["name"]


def all_stopped(api: Api, node: ContainerKubelet) -> None:
    api.wait("every container to have stopped", lambda: not node.running(), 60)


@pytest.fixture(autouse=True)
def _clock(request: pytest.FixtureRequest):
    """Prints each test's time (`pytest -s`), for the images' notes."""
    start = time.monotonic()
    yield
    print(f"\n[container test time] {request.node.name}: {time.monotonic() - start:.0f} s")


@pytest.mark.slow  # the DLRM example below is a HybridJob in containers, on a volume too
def test_a_hybrid_job_trains_in_containers(cluster, container_kubelet, operator):
    api, node = cluster.api, container_kubelet
    name = start(api, HYBRID)
    done = jobs.wait_phase(api, "HybridJob", name, "Succeeded", timeout=300)
    assert done["status"]["restarts"] == 0, (done["status"], jobs.warnings(api))
    assert "step 10/10" in node.logs(NS, f"{name}-master-0")
    all_stopped(api, node)


def test_the_dlrm_example_trains_in_containers_on_logs_on_a_volume(
    cluster, container_kubelet, operator
):
    """The DLRM example's 26 tables on 2 parameter server containers, its click logs on a
    volume: it trains, evaluates (status shows the AUC) and writes its model there."""
    api, node = cluster.api, container_kubelet
    claim(api)
    volume = node.claim_dir(NS, CLAIM)
    volume.mkdir(parents=True, exist_ok=True)
    for log in ("train.tsv", "val.tsv"):
        shutil.copy(jobs.EXAMPLES / "dlrm" / log, volume / log)
    name = start(
        api,
        ("dlrm/hybridjob.yaml", {}),
        steps=30,
        logEvery=10,
        eval={"everySteps": 30},
        output={"path": "/data/out"},
        logging={"tensorboard": "/data/runs"},
        template=on_claim(),
        data={"criteo": {"train": "/data/train.tsv", "val": "/data/val.tsv"}},
    )
    done = jobs.wait_phase(api, "HybridJob", name, "Succeeded", timeout=400)
    assert done["status"]["restarts"] == 0, (done["status"], jobs.warnings(api))
    assert len({r.name for r in node.runs(NS)}) == 5  # master, ps-0, ps-1, 2 trainers
    training = done["status"]["training"]
    assert training["evalStep"] == 30 and training["evalAuc"] > 0.6, training
    assert "AUC" in node.logs(NS, f"{name}-master-0")
    assert (volume / "out" / "model.safetensors").stat().st_size > 26 * 1000 * 8 * 4
    all_stopped(api, node)


@pytest.mark.slow  # test_hybrid.py splits the same table across four processes under the limit
def test_a_table_over_one_containers_memory_limit_trains_split_across_four(
    cluster, container_kubelet, operator
):
    """The 1.4 GB table of tests/test_hybrid.py on four parameter server containers, each
    limited to 1200Mi by docker (an OOM kill otherwise): the job succeeds, and each server's
    peak, as the status reports it, is under the limit."""
    from test_hybrid import HUGE, LIMIT

    api, node = cluster.api, container_kubelet
    name = jobs.create(api, HUGE)["metadata"]["name"]
    done = jobs.wait_phase(api, "HybridJob", name, "Succeeded", timeout=400)
    assert done["status"]["restarts"] == 0, (done["status"], jobs.warnings(api))
    peaks = {m: f["rssPeakBytes"] for m, f in done["status"]["training"]["memory"].items()}
    servers = [peaks[f"ps{i}"] for i in range(4)]
    assert all(350_000_000 < peak < LIMIT for peak in servers), peaks
    print(f"\n[peak memory in containers] {peaks}")
    all_stopped(api, node)


# A transformer whose 200,000-token embedding and head make its stages peak at 1.2 and 1.6 GB
# (`pipejob run`: master 0.76 GB): over a 1100Mi limit, under 1.5x it (1650Mi).
OOMY = {
    "apiVersion": "pipejob.dev/v1alpha1",
    "kind": "PipelineJob",
    "metadata": {"name": "oomy"},
    "spec": {
        "model": {
            "transformer": {
                "vocabSize": 200_000,
                "layers": 2,
                "width": 256,
                "heads": 4,
                "seqLen": 16,
            }
        },
        "stages": 2,
        "microBatches": 2,
        "batchSize": 4,
        "steps": 3,
        "optimizer": {"name": "sgd", "lr": 0.01},
        "preflight": {"megabytes": 0.5},
        "template": {"resources": {"limits": {"memory": "1100Mi"}}},
    },
}


# slow: two worlds of containers, minutes; tests/test_operator_integration.py's
# test_an_oom_killed_stage_comes_back_with_more_memory_then_fails_at_the_cap holds the decision
@pytest.mark.slow
def test_an_oom_killed_stage_comes_back_with_1_5x_memory_and_succeeds_and_at_the_cap_fails(
    cluster, container_kubelet, operator
):
    """Docker's cgroup limit kills a stage for memory: its world comes back with 1650Mi for
    every stage, spending no backoffLimit, and succeeds; the same job capped at 1100Mi fails
    naming the role and the memory."""
    api, node = cluster.api, container_kubelet
    capped = {**OOMY, "metadata": {"name": "capped"}}
    capped["spec"] = {**OOMY["spec"], "backoffLimit": 0, "oom": {"maxMemory": "1100Mi"}}
    jobs.create(api, capped)
    done = jobs.wait_phase(api, "PipelineJob", "capped", "Failed", timeout=300)
    [failed] = [c for c in done["status"]["conditions"] if c["type"] == "Failed"]
    assert failed["reason"] == "OOMKilled", (failed, jobs.warnings(api))
    assert "role stage needs more than 1100Mi" in failed["message"], failed
    all_stopped(api, node)
    jobs.create(api, {**OOMY, "spec": {**OOMY["spec"], "backoffLimit": 0}})
    done = jobs.wait_phase(api, "PipelineJob", "oomy", "Succeeded", timeout=400)
    status = done["status"]
    assert status["restarts"] == 0 and status["oomKills"] == 1, (status, jobs.warnings(api))
    assert status["memory"] == {"stage": "1650Mi"}, status
    assert any("killed for memory (OOMKilled) at 1100Mi" in w for w in jobs.warnings(api))
    limits = {r.name: r.pod["spec"]["containers"][0]["resources"]["limits"] for r in node.runs(NS)}
    assert limits["oomy-stage-1"] == {"memory": "1650Mi"}, limits
    assert limits["oomy-master-0"] == {"memory": "1100Mi"}, limits
    all_stopped(api, node)


@pytest.mark.slow  # replicas in containers: the pipelining test below resumes them too
def test_a_pipeline_job_with_two_replicas_trains_in_containers(
    cluster, container_kubelet, operator
):
    api, node = cluster.api, container_kubelet
    name = start(api, PIPELINE, replicas=2)
    done = jobs.wait_phase(api, "PipelineJob", name, "Succeeded", timeout=300)
    assert done["status"]["restarts"] == 0 and done["status"]["replicas"] == 2
    assert len({r.name for r in node.runs(NS)}) == 5  # the master and 2 replicas of 2 stages
    assert "2 replicas (all-reduce" in node.logs(NS, f"{name}-master-0")
    all_stopped(api, node)


@pytest.mark.slow  # 3 minutes; the pipelining replicas' resume below recreates a world too
def test_a_killed_stage_container_recreates_the_world_which_resumes_from_its_checkpoint(
    cluster, container_kubelet, operator
):
    api, node = cluster.api, container_kubelet
    claim(api)
    checkpoint = {"path": "/data/checkpoints", "everySteps": 2}
    name = start(api, PIPELINE, steps=30, checkpoint=checkpoint, template=on_claim())
    master = f"{name}-master-0"
    api.wait(
        "a complete checkpoint of step 2 or later on the volume",
        lambda: "step 4/30" in node.logs(NS, master),
        300,
    )
    first = node.run(NS, f"{name}-stage-1").pod["metadata"]["uid"]
    node.kill(NS, f"{name}-stage-1")  # docker kill: SIGKILL, as an OOM kill would
    done = jobs.wait_phase(api, "PipelineJob", name, "Succeeded", timeout=400)
    assert done["status"]["restarts"] == 1, (done["status"], jobs.warnings(api))
    assert node.run(NS, f"{name}-stage-1").pod["metadata"]["uid"] != first  # a new world
    log = node.logs(NS, master)  # both masters' logs, the second one's last
    resumed = log.split("resumed from step ")
    assert len(resumed) == 2 and int(resumed[1].split()[0]) >= 2, log[-3000:]
    assert "step 30/30" in resumed[1]
    all_stopped(api, node)


# slow: six minutes; test_operator_e2e.py's pipelining replicas resume, the DLRM example
# here uses a volume
@pytest.mark.slow
def test_a_pipelining_job_with_replicas_resumes_after_a_killed_container(
    cluster, container_kubelet, operator
):
    """The pipelining engine in containers (its stages' group over the bridge network, as
    pods reach each other), with 2 replicas: a stage container killed after a checkpoint
    recreates the world, which resumes from the checkpoint on the volume and succeeds."""
    api, node = cluster.api, container_kubelet
    claim(api)
    checkpoint = {"path": "/data/checkpoints", "everySteps": 2}
    name = start(
        api,
        PIPELINE,
        engine="pipelining",
        schedule="1f1b",
        replicas=2,
        steps=12,
        checkpoint=checkpoint,
        template=on_claim(),
    )
    master = f"{name}-master-0"
    api.wait(
        "a complete checkpoint of step 2 or later on the volume",
        lambda: "step 4/12" in node.logs(NS, master),
        300,
    )
    node.kill(NS, f"{name}-r1-stage-0")
    done = jobs.wait_phase(api, "PipelineJob", name, "Succeeded", timeout=400)
    assert done["status"]["restarts"] == 1, (done["status"], jobs.warnings(api))
    log = node.logs(NS, master)  # both masters' logs, the second one's last
    resumed = log.split("resumed from step ")
    assert len(resumed) == 2 and int(resumed[1].split()[0]) >= 2, log[-3000:]
    assert "step 12/12" in resumed[1] and "on the pipelining engine (1f1b)" in resumed[1]
    all_stopped(api, node)


def test_the_custom_model_example_builds_on_the_trainer_image_and_trains(
    cluster, container_kubelet, operator, images
):
    api, node = cluster.api, container_kubelet
    tag = "pipejob/custom-model:test"
    subprocess.run(
        [
            "docker",
            "build",
            "--network",
            "none",
            "-t",
            tag,
            "--build-arg",
            f"TRAINER_IMAGE={images.trainer}",
            str(EXAMPLE),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    claim(api)
    manifest = yaml.safe_load((EXAMPLE / "pipelinejob.yaml").read_text())
    manifest["spec"] |= {
        "steps": 10,
        "logEvery": 5,
        "eval": {"everySteps": 10},
        "output": {"path": "/data/out"},
        "data": {**manifest["spec"]["data"], "workers": 0, "args": {"size": 200}},
        "template": on_claim() | {"image": tag},
    }
    name = jobs.create(api, manifest)["metadata"]["name"]
    jobs.wait_phase(api, "PipelineJob", name, "Succeeded", timeout=300)
    pod = api.get("v1/pods", f"{name}-master-0", NS)
    assert pod["spec"]["containers"][0]["image"] == tag
    assert (node.claim_dir(NS, CLAIM) / "out" / "model.safetensors").stat().st_size > 0
    all_stopped(api, node)


@pytest.mark.parametrize("wrong", ["missing", "operator"])
def test_a_job_whose_image_cannot_run_the_trainer_fails_at_once_saying_why(
    cluster, container_kubelet, operator, images, wrong
):
    """An image no node has, or one without the trainer (the operator's: pipejob.core but no
    pipejob.trainer): Failed with the image named, no restart spent, nothing left running."""
    api, node = cluster.api, container_kubelet
    image, reason = {
        "missing": ("pipejob/no-such-image:dev", "ImagePullFailed"),
        "operator": (images.operator, "ImageLacksPipejob"),
    }[wrong]
    name = start(api, PIPELINE, template={"image": image})
    done = jobs.wait_phase(api, "PipelineJob", name, "Failed", timeout=180)
    assert done["status"]["restarts"] == 0, (done["status"], jobs.warnings(api))
    [failed] = [c for c in done["status"]["conditions"] if c["type"] == "Failed"]
    assert failed["reason"] == reason, failed
    assert f"image {image!r} cannot" in failed["message"], failed
    all_stopped(api, node)


def test_the_operator_installed_from_its_chart_runs_from_its_image_and_a_job_succeeds(
    cluster, container_kubelet, chart_operator, images
):
    api, node, pod = cluster.api, container_kubelet, chart_operator
    container = pod["spec"]["containers"][0]
    assert container["image"] == images.operator and pod["spec"]["serviceAccountName"]
    assert "--all-namespaces" in container["args"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # helm's release record (a Secret client-go sent as protobuf), as `helm list` reads it.
    releases = api.list("v1/secrets", pod["metadata"]["namespace"], labelSelector="owner=helm")
    assert [r["metadata"]["labels"]["status"] for r in releases] == ["deployed"]
    claim(api)
    name = start(
        api, PIPELINE, eval={"everySteps": 3}, output={"path": "/data/out"}, template=on_claim()
    )
    done = jobs.wait_phase(api, "PipelineJob", name, "Succeeded", timeout=300)
    assert done["status"]["restarts"] == 0, (done["status"], jobs.warnings(api))
    master = api.get("v1/pods", f"{name}-master-0", NS)
    assert master["spec"]["containers"][0]["image"] == images.trainer  # the chart's trainerImage
    terminated = master["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0 and terminated["containerID"].startswith("docker://")
    log = node.logs(NS, f"{name}-master-0")
    assert "step 3/3" in log and "eval" in log.lower()
    out = node.claim_dir(NS, CLAIM) / "out"
    assert json.loads((out / "model.json").read_text())
    # Written by the pods' user, uid 10001 (the image's), not root.
    assert (out / "model.safetensors").stat().st_uid == 10001
    operator_log = node.logs(pod["metadata"]["namespace"], pod["metadata"]["name"])
    assert name in operator_log
    all_stopped_but_operator = lambda: [r for r in node.running() if r.namespace == NS] == []  # noqa: E731
    api.wait("every job container to have stopped", all_stopped_but_operator, 60)


# Run inside a container: for each target, "open" (a connection was made), "blocked" (no
# answer at all: a policy dropped it) or "refused"; for a URL, "answers" when it gave
# pipejob's metrics. As JSON on stdout.
PROBE = r"""
import json, socket, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor

def reach(target):
    try:
        if target.startswith("http"):
            body = urllib.request.urlopen(target, timeout=5).read()
            return "answers" if b"pipejob_" in body else "wrong answer"
        host, port = target.rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=5).close()
        return "open"
    except TimeoutError:
        return "blocked"
    except OSError as e:
        return "blocked" if "timed out" in str(e) else f"refused ({e})"

targets = sys.argv[1:]
with ThreadPoolExecutor(len(targets)) as pool:
    print(json.dumps(dict(zip(targets, pool.map(reach, targets)))))
"""
# The values' Prometheus: pods so labelled in namespace monitoring may read the monitor port.
PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}
MONITORING = "monitoring"


@pytest.fixture
def prometheus_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's NetworkPolicy setting as the chart writes it for these values."""
    peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": MONITORING}},
        "podSelector": {"matchLabels": PROMETHEUS_LABELS},
    }
    monkeypatch.setenv(POLICY_ENV, json.dumps({"monitorFrom": [peer]}))


def address(api: Api, pod: str, port: str) -> str:
    """host:port of a pod's port, as the world plan gave it (the env variable `port`)."""
    found = api.get("v1/pods", pod, NS)
    return f"{found['status']['podIP']}:{jobs.env(found)[port]}"


def probe_from_pod(
    api: Api,
    node: ContainerKubelet,
    image: str,
    name: str,
    namespace: str,
    labels: dict,
    targets: list[str],
) -> dict[str, str]:
    """What a pod outside every world reaches of `targets`."""
    container = {"name": "probe", "image": image, "command": ["python", "-c", PROBE, *targets]}
    api.create(
        "v1/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels},
            "spec": {"restartPolicy": "Never", "containers": [container]},
        },
        namespace,
    )

    def finished() -> bool:
        phase = (api.get("v1/pods", name, namespace).get("status") or {}).get("phase")
        return phase in ("Succeeded", "Failed")

    api.wait(f"probe pod {name} to finish", finished, 120)
    return json.loads(node.logs(namespace, name).strip().splitlines()[-1])


def probe_from_member(node: ContainerKubelet, pod: str, targets: list[str]) -> dict[str, str]:
    """What a running member of a world reaches of `targets` (from inside its container)."""
    out = cli("exec", node.run(NS, pod).container, "python", "-c", PROBE, *targets, timeout=60)
    return json.loads(out.strip().splitlines()[-1])


# slow: five minutes, nine containers: the policy's rules in test_network_policy.py, the pods it
# selects in test_operator_integration.py
@pytest.mark.slow
def test_a_world_admits_only_its_members_and_its_monitor_port_the_allowed_prometheus(
    cluster, container_kubelet, images, prometheus_allowed, operator
):
    """A replicated PipelineJob and a HybridJob train side by side, each world behind its own
    NetworkPolicy, enforced on the bridge as a network plugin would. While they train: a pod
    outside both worlds (Prometheus's labels in the wrong namespace) reaches neither master's
    RPC port, a trainer's DDP port or a monitor port; the values' Prometheus reads the
    monitor ports and nothing else; a member reaches its own world's ports and not the other
    world's. The worlds train on (every connection between their members is their own), and
    deleted while they run, they leave no pod, container or policy behind."""
    api, node = cluster.api, container_kubelet
    pipeline = start(api, PIPELINE, replicas=2, steps=100000, logEvery=1)
    hybrid = start(api, HYBRID, steps=1000000, logEvery=10)
    for master, step in ((f"{pipeline}-master-0", "step 2/"), (f"{hybrid}-master-0", "step 10/")):
        api.wait(f"{master} training", lambda m=master, s=step: s in node.logs(NS, m), 300)
    rpc = {job: address(api, f"{job}-master-0", "MASTER_PORT") for job in (pipeline, hybrid)}
    ddp = address(api, f"{hybrid}-trainer-0", "PIPEJOB_DDP_PORT")
    monitor = [
        f"http://{address(api, f'{job}-master-0', 'PIPEJOB_MONITOR_PORT')}/metrics"
        for job in (pipeline, hybrid)
    ]
    ports = [rpc[pipeline], rpc[hybrid], ddp]
    everything = [*ports, *monitor]

    outside = probe_from_pod(
        api, node, images.trainer, "outsider", NS, PROMETHEUS_LABELS, everything
    )
    assert outside == dict.fromkeys(everything, "blocked"), outside
    prometheus = probe_from_pod(
        api, node, images.trainer, "prometheus", MONITORING, PROMETHEUS_LABELS, everything
    )
    assert prometheus == {**dict.fromkeys(ports, "blocked"), **dict.fromkeys(monitor, "answers")}, (
        prometheus
    )
    # A member of replica 1, and a trainer: their own world's ports, not the other's.
    stage = probe_from_member(node, f"{pipeline}-r1-stage-1", ports)
    assert stage == {rpc[pipeline]: "open", rpc[hybrid]: "blocked", ddp: "blocked"}, stage
    trainer = probe_from_member(node, f"{hybrid}-trainer-1", ports)
    assert trainer == {rpc[pipeline]: "blocked", rpc[hybrid]: "open", ddp: "open"}, trainer

    # Deleting the running jobs leaves nothing behind: pods, containers, policies.
    api.delete("v1/pods", "outsider", NS)
    api.delete("v1/pods", "prometheus", MONITORING)
    # The master and 2 replicas of 2 stages; the master, ps and 2 trainers.
    api.wait("the probes' containers removed", lambda: len(node.containers()) == 5 + 4, 60)
    for kind, name in (("PipelineJob", pipeline), ("HybridJob", hybrid)):
        job = jobs.get(api, kind, name)
        assert job["status"]["phase"] == "Running" and job["status"]["restarts"] == 0, job
        api.delete(jobs.resource(kind), name, NS)
    api.wait("no pods", lambda: api.list("v1/pods", NS) == [], 60)
    api.wait("no containers", lambda: node.containers() == [], 60)
    assert api.list("networking.k8s.io/v1/networkpolicies", NS) == []
    print(
        f"outsider {outside}\nprometheus {prometheus}\nstage {stage}\ntrainer {trainer}",
        file=sys.stderr,
    )
