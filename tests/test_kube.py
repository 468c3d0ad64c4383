"""The plain-dict Service and Pods of a job (kube.py) and `pipejob render`."""

import pytest
import yaml

from pipejob.cli import main as cli
from pipejob.core import contract, spec
from pipejob.core.plan import plan_world
from pipejob.operator import kube

pytestmark = pytest.mark.timeout(30)

UID = "6f1c2c1e-0000-4000-8000-000000000001"


def manifest(kind="PipelineJob", name="pj", **fields):
    return {
        "apiVersion": spec.API_VERSION,
        "kind": kind,
        "metadata": {"name": name, "namespace": "team", "uid": UID},
        "spec": fields,
    }


def world(kind="PipelineJob", restart=0, image=None, **fields):
    obj = manifest(kind, **fields)
    job = spec.parse(obj)
    return job, kube.world(job, restart, "team", kube.owner_reference(obj), image)


def env_of(pod):
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_one_pod_per_process_named_role_index_with_dns_identity():
    job, pods = world(stages=3)
    names = [p["metadata"]["name"] for p in pods]
    assert names == ["pj-master-0", "pj-stage-0", "pj-stage-1", "pj-stage-2"]
    for pod in pods:
        assert pod["spec"]["hostname"] == pod["metadata"]["name"]
        assert pod["spec"]["subdomain"] == "pj"  # the headless Service
        assert pod["spec"]["restartPolicy"] == "Never"
        assert env_of(pod)[contract.MASTER_ADDR] == "pj-master-0.pj"
    ranks = [env_of(p)[contract.RANK] for p in pods]
    assert ranks == ["0", "1", "2", "3"]


def test_env_is_the_plan_env_plus_template_env():
    job, pods = world(template={"env": [{"name": "NCCL_DEBUG", "value": "INFO"}]})
    planned = plan_world(job, kube.addresser(job))
    for pod, process in zip(pods, planned, strict=True):
        env = pod["spec"]["containers"][0]["env"]
        assert env[: len(process.env)] == [{"name": k, "value": v} for k, v in process.env.items()]
        assert env[-1] == {"name": "NCCL_DEBUG", "value": "INFO"}


def test_container_runs_the_trainer_and_exposes_the_rendezvous_ports():
    _, pods = world("HybridJob", trainers=2)
    by_role = {kube.role_of(p): p["spec"]["containers"][0] for p in pods}
    assert by_role["master"]["command"] == ["python", "-m", "pipejob.trainer"]
    assert by_role["master"]["ports"] == [
        {"name": "rpc", "containerPort": 29500},
        {"name": "preflight", "containerPort": 29502},  # the preflight group's store
        {"name": "monitor", "containerPort": 29503},  # /progress and /metrics
    ]
    assert by_role["ps"]["ports"] == [{"name": "rpc", "containerPort": 29500}]
    assert by_role["trainer"]["ports"] == [
        {"name": "rpc", "containerPort": 29500},
        {"name": "ddp", "containerPort": 29501},
    ]
    trainer_env = {e["name"]: e["value"] for e in by_role["trainer"]["env"]}
    assert trainer_env[contract.DDP_ADDR] == "pj-trainer-0.pj"


def test_labels_owner_and_restart_generation():
    _, pods = world(restart=2)
    pod = pods[1]
    labels = pod["metadata"]["labels"]
    assert labels[kube.JOB_LABEL] == "pj"
    assert labels[kube.ROLE_LABEL] == "stage"
    assert labels[kube.INDEX_LABEL] == "0"
    assert labels[kube.RESTART_LABEL] == "2"
    assert kube.restart_of(pod) == 2
    (owner,) = pod["metadata"]["ownerReferences"]
    assert owner == {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "name": "pj",
        "uid": UID,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert pod["metadata"]["namespace"] == "team"


def test_pods_carry_the_digest_of_the_spec_they_were_made_from():
    job, pods = world(stages=2)
    assert {kube.spec_hash_of(p) for p in pods} == {kube.spec_hash(job)}
    steering = spec.parse(manifest(stages=2, backoffLimit=9, suspend=True))
    assert kube.spec_hash(steering) == kube.spec_hash(job)
    assert kube.spec_hash(spec.parse(manifest(stages=3))) != kube.spec_hash(job)


def test_restricted_security_context_by_default():
    _, pods = world()
    for pod in pods:
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert pod["spec"]["automountServiceAccountToken"] is False
        sc = pod["spec"]["containers"][0]["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["runAsNonRoot"] is True
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}


def test_gpus_per_role_become_nvidia_gpu_requests_and_limits():
    template = {"resources": {"limits": {"cpu": "4"}, "requests": {"memory": "8Gi"}}}
    _, pods = world(gpusPerStage=1, template=template)
    master, stage = (p["spec"]["containers"][0]["resources"] for p in pods[:2])
    assert master == {"limits": {"cpu": "4"}, "requests": {"memory": "8Gi"}}
    assert stage == {
        "limits": {"cpu": "4", "nvidia.com/gpu": 1},
        "requests": {"memory": "8Gi", "nvidia.com/gpu": 1},
    }
    _, cpu_pods = world()
    assert "resources" not in cpu_pods[1]["spec"]["containers"][0]


def test_hybrid_gpus_go_to_trainers_only():
    _, pods = world("HybridJob", trainers=2, gpusPerTrainer=1)
    gpus = {
        p["metadata"]["name"]: p["spec"]["containers"][0]
        .get("resources", {})
        .get("limits", {})
        .get("nvidia.com/gpu")
        for p in pods
    }
    assert gpus == {"pj-master-0": None, "pj-ps-0": None, "pj-trainer-0": 1, "pj-trainer-1": 1}


def test_template_overrides():
    template = {
        "image": "registry.example/trainer:dev",
        "imagePullPolicy": "Always",
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {}},
        "volumes": [{"name": "data", "emptyDir": {}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "serviceAccountName": "trainer",
        "schedulerName": "volcano",
        "priorityClassName": "high",
    }
    _, pods = world(template=template)
    pod_spec = pods[0]["spec"]
    container = pod_spec["containers"][0]
    assert container["image"] == "registry.example/trainer:dev"
    assert container["imagePullPolicy"] == "Always"
    assert container["volumeMounts"] == template["volumeMounts"]
    for key in (
        "nodeSelector",
        "tolerations",
        "affinity",
        "volumes",
        "serviceAccountName",
        "schedulerName",
        "priorityClassName",
    ):
        assert pod_spec[key] == template[key], key
    assert pod_spec["automountServiceAccountToken"] is True  # the user asked for an account


def test_template_objects_are_copied_not_shared():
    _, pods = world(template={"volumes": [{"name": "v", "emptyDir": {}}]})
    pods[0]["spec"]["volumes"][0]["name"] = "changed"
    assert pods[1]["spec"]["volumes"][0]["name"] == "v"


def test_default_image_comes_from_the_operator_environment(monkeypatch):
    monkeypatch.delenv(kube.IMAGE_ENV, raising=False)
    assert world()[1][0]["spec"]["containers"][0]["image"] == kube.DEFAULT_IMAGE
    monkeypatch.setenv(kube.IMAGE_ENV, "mirror.local/trainer:1")
    assert world()[1][0]["spec"]["containers"][0]["image"] == "mirror.local/trainer:1"
    assert world(image="given:2")[1][0]["spec"]["containers"][0]["image"] == "given:2"


def test_headless_service_publishes_not_ready_addresses():
    obj = manifest("HybridJob")
    svc = kube.service(spec.parse(obj), "team", kube.owner_reference(obj))
    assert svc["metadata"]["name"] == "pj"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {kube.JOB_LABEL: "pj"}
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [
        ("rpc", 29500),
        ("ddp", 29501),
        ("preflight", 29502),
        ("monitor", 29503),
    ]
    # One pipeline on the rpc engine has no group; by default (engine auto) its stages are
    # seated in the pipelining engine's group, whose rendezvous is the ddp port.
    pipeline = kube.service(spec.parse(manifest(engine="rpc")), "team")
    assert [p["name"] for p in pipeline["spec"]["ports"]] == ["rpc", "preflight", "monitor"]
    pipeline = kube.service(spec.parse(manifest()), "team")
    assert [p["name"] for p in pipeline["spec"]["ports"]] == ["rpc", "ddp", "preflight", "monitor"]
    assert svc["metadata"]["ownerReferences"][0]["uid"] == UID


@pytest.mark.parametrize(
    ("template", "path", "words"),
    [
        (
            {"env": [{"name": "MASTER_ADDR", "value": "x"}]},
            "spec.template.env[0].name",
            "set by pipejob",
        ),
        ({"env": [{"value": "x"}]}, "spec.template.env[0].name", "is required"),
        (
            {"volumeMounts": [{"name": "data", "mountPath": "/d"}]},
            "spec.template.volumeMounts[0].name",
            "no volume 'data'",
        ),
    ],
)
def test_parse_names_what_no_pod_could_run_with(template, path, words):
    with pytest.raises(spec.InvalidSpec) as refused:
        spec.parse(manifest(template=template))
    (error,) = refused.value.errors
    assert error.path == path
    assert words in error.reason


def test_a_failed_trainer_says_why_in_its_termination_message():
    _, pods = world()
    for pod in pods:
        assert pod["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"


CHECKPOINT_TEMPLATE = {
    "volumes": [
        {"name": "data", "emptyDir": {}},
        {"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}},
    ],
    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
}


def test_the_checkpoint_volume_is_mounted_at_the_checkpoint_path_in_every_pod():
    checkpoint = {"path": "/ckpt/run1", "volume": "ckpt"}
    for kind in ("PipelineJob", "HybridJob"):
        job, pods = world(kind, checkpoint=checkpoint, template=CHECKPOINT_TEMPLATE)
        assert len(pods) == kube.world_size(job)
        for pod in pods:
            assert pod["spec"]["containers"][0]["volumeMounts"] == [
                {"name": "data", "mountPath": "/data"},  # the template's own, first
                {"name": "ckpt", "mountPath": "/ckpt/run1"},
            ]
            assert pod["spec"]["volumes"] == CHECKPOINT_TEMPLATE["volumes"]
    # Without a volume the template is expected to mount the path itself: nothing is added.
    _, pods = world(checkpoint={"path": "/data/ckpt"}, template=CHECKPOINT_TEMPLATE)
    assert pods[0]["spec"]["containers"][0]["volumeMounts"] == [
        {"name": "data", "mountPath": "/data"}
    ]


@pytest.mark.parametrize(
    ("checkpoint", "template", "path", "words"),
    [
        (
            {"path": "/ckpt", "volume": "ckpt"},
            {},
            "spec.checkpoint.volume",
            "no volume 'ckpt' in spec.template.volumes",
        ),
        (
            {"path": "/ckpt", "volume": "nope"},
            CHECKPOINT_TEMPLATE,
            "spec.checkpoint.volume",
            "no volume 'nope'",
        ),
        (
            {"path": "ckpt", "volume": "ckpt"},
            CHECKPOINT_TEMPLATE,
            "spec.checkpoint.path",
            "must be an absolute path",
        ),
        (
            {"path": "/data/", "volume": "ckpt"},
            CHECKPOINT_TEMPLATE,
            "spec.checkpoint.volume",
            "spec.template.volumeMounts[0] mounts '/data/' already",
        ),
    ],
)
def test_parse_refuses_a_checkpoint_volume_no_pod_could_mount(checkpoint, template, path, words):
    with pytest.raises(spec.InvalidSpec) as refused:
        spec.parse(manifest(checkpoint=checkpoint, template=template))
    (error,) = refused.value.errors
    assert error.path == path
    assert words in error.reason


def test_parse_passes_a_good_template():
    template = {
        "env": [{"name": "A", "value": "1"}],
        "volumes": [{"name": "d", "emptyDir": {}}],
        "volumeMounts": [{"name": "d", "mountPath": "/d"}],
    }
    assert spec.parse(manifest(template=template)).spec["template"] == template


def test_render_prints_service_policy_and_pods_without_owners(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    body = manifest(stages=2)
    del body["metadata"]["uid"], body["metadata"]["namespace"]
    path.write_text(yaml.safe_dump(body))
    assert cli.main(["render", str(path), "--namespace", "ml", "--image", "t:1"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["Service", "NetworkPolicy", "Pod", "Pod", "Pod"]
    for doc in docs:
        assert doc["metadata"]["namespace"] == "ml"
        assert "ownerReferences" not in doc["metadata"]
    assert docs[2]["spec"]["containers"][0]["image"] == "t:1"


def test_render_refuses_a_bad_manifest_naming_the_field(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    body = manifest(template={"env": [{"name": "RANK", "value": "3"}]})
    path.write_text(yaml.safe_dump(body))
    assert cli.main(["render", str(path)]) == 2
    err = capsys.readouterr().err
    assert "spec.template.env[0].name" in err and "RANK" in err


def test_a_replicated_pipeline_renders_every_replica_and_its_groups():
    job, pods = world(stages=2, replicas=2, engine="rpc")  # the rpc engine's dp groups
    names = [p["metadata"]["name"] for p in pods]
    assert names == [
        "pj-master-0",
        "pj-r0-stage-0",
        "pj-r0-stage-1",
        "pj-r1-stage-0",
        "pj-r1-stage-1",
    ]
    for pod in pods[1:]:
        labels = pod["metadata"]["labels"]
        replica, index = int(labels[kube.REPLICA_LABEL]), int(labels[kube.INDEX_LABEL])
        assert pod["spec"]["hostname"] == pod["metadata"]["name"]
        assert kube.process_name(pod) == f"stage {index} of replica {replica}"
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
        # stage i of every replica: group dp<i>, rendezvous on replica 0's stage i
        assert env[contract.DDP_GROUP] == f"dp{index}"
        assert env[contract.DDP_ADDR] == f"pj-r0-stage-{index}.pj"
        assert env[contract.DDP_RANK] == str(replica)
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert ports["ddp"] == kube.PORTS.group_port(index)  # dp0 on 29501, dp1 on 29511
    assert kube.REPLICA_LABEL not in pods[0]["metadata"]["labels"]
    service = kube.service(job, "team")
    assert "ddp" in {p["name"] for p in service["spec"]["ports"]}
    # one pipeline: pods, labels and the Service as before replicas existed
    _, single = world(stages=2)
    assert [p["metadata"]["name"] for p in single] == ["pj-master-0", "pj-stage-0", "pj-stage-1"]
    assert all(kube.REPLICA_LABEL not in p["metadata"]["labels"] for p in single)
    assert "ddp" not in {
        p["name"] for p in kube.service(spec.parse(manifest(engine="rpc")), "t")["spec"]["ports"]
    }
