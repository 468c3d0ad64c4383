"""What the operator makes of a stalled world, and the checkpoints that would be lost without a
word (issue 19): an empty `checkpoint.path`, and a multi-pod world checkpointing on no volume,
refused on a cluster (`render`, the operator) and accepted by the local runner."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime

import pytest
import yaml
from test_failures import fail
from test_reconcile import Sim

from pipejob.core import contract
from pipejob.core.contract import ExitCode
from pipejob.core.spec import API_VERSION, InvalidSpec, parse
from pipejob.operator import crd, reconcile
from pipejob.operator import status as st

pytestmark = pytest.mark.timeout(60)

STALLED = (
    f"{contract.STALLED_PREFIX} stage1 (pod j-stage-1) stopped answering: no heartbeat"
    " for 61 s, last seen in training at step 34"
)


def test_a_stalled_world_restarts_with_reason_stalled_and_an_event_naming_the_member():
    sim = Sim(stages=2, backoffLimit=3)
    sim.reconcile()
    sim.run_all()
    fail(sim, "j-master-0", ExitCode.STALLED, STALLED)
    acts = sim.reconcile()
    assert sim.status["phase"] == st.RESTARTING and sim.status["restarts"] == 1
    restarting = st.condition(sim.status, st.RESTARTING)
    assert restarting["reason"] == "Stalled"
    assert restarting["message"].startswith(
        "stage1 (pod j-stage-1) stopped answering: no heartbeat for 61 s, last seen in training"
        " at step 34 (found by master 0, pod j-master-0); restarting the world (1/3)"
    )
    assert [(e.type, e.reason) for e in acts.events] == [("Warning", "Stalled")]
    assert "stage1 (pod j-stage-1) stopped answering" in acts.events[0].message
    deleted = {p["metadata"]["name"] for p in acts.delete}  # the frozen pod too
    assert deleted == {"j-master-0", "j-stage-0", "j-stage-1"}


def test_a_pod_that_only_lost_its_peers_is_not_named_the_cause_even_if_it_ended_first():
    sim = Sim(stages=2, backoffLimit=3)
    sim.reconcile()
    sim.run_all()
    broke = f"{contract.BROKEN_PREFIX} RuntimeError: EOF: end of file; another member failed"
    fail(sim, "j-stage-0", ExitCode.TRAINING_FAILED, broke)
    sim.pods["j-stage-0"]["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = (
        "2025-01-02T03:04:59Z"  # a second before the stall's verdict
    )
    fail(sim, "j-master-0", ExitCode.STALLED, STALLED)
    sim.reconcile()
    restarting = st.condition(sim.status, st.RESTARTING)
    assert restarting["reason"] == "Stalled" and "stage1 (pod j-stage-1)" in restarting["message"]


BROKE = f"{contract.BROKEN_PREFIX} RuntimeError: EPIPE: broken pipe; another member failed"
FINISHED = datetime.fromisoformat("2025-01-02T03:05:00+00:00")  # Sim.set_phase's finishedAt


def test_a_permanent_cause_that_ends_after_its_peers_fails_the_job_without_a_restart():
    sim = Sim(stages=2, backoffLimit=3)
    sim.reconcile()
    sim.run_all()
    sim.now = FINISHED
    for stage in ("j-stage-0", "j-stage-1"):  # they lost the master, which still runs
        fail(sim, stage, ExitCode.TRAINING_FAILED, BROKE)
    sim.reconcile()
    assert sim.status["restarts"] == 0 and sim.status["phase"] != st.RESTARTING
    cause = contract.permanent_message("ImportFailed", "training failed: ImportError: no x")
    fail(sim, "j-master-0", ExitCode.PERMANENT, cause)
    sim.reconcile()
    assert sim.status["phase"] == st.FAILED and sim.status["restarts"] == 0
    assert st.condition(sim.status, st.FAILED)["reason"] == "ImportFailed"


def test_peers_that_lost_the_world_restart_it_when_no_cause_ends_within_the_grace():
    sim = Sim(stages=2, backoffLimit=3)
    sim.reconcile()
    sim.run_all()
    fail(sim, "j-stage-0", ExitCode.TRAINING_FAILED, BROKE)
    sim.now = FINISHED
    sim.reconcile()  # the others still run: the cause may yet end
    assert sim.status["restarts"] == 0
    sim.now = FINISHED + reconcile.CAUSE_GRACE
    sim.reconcile()
    assert sim.status["phase"] == st.RESTARTING and sim.status["restarts"] == 1


def waiting(sim: Sim, pod: str, reason: str, message: str) -> None:
    sim.pods[pod]["status"]["containerStatuses"] = [
        {"name": "trainer", "state": {"waiting": {"reason": reason, "message": message}}}
    ]


def test_a_pod_that_cannot_pull_its_image_fails_the_job_naming_the_image():
    sim = Sim(stages=2)
    sim.reconcile()
    sim.set_phase("j-master-0", "Running")
    waiting(sim, "j-stage-1", "ErrImagePull", "pull access denied for nope")
    image = sim.pods["j-stage-1"]["spec"]["containers"][0]["image"]
    acts = sim.reconcile()
    assert sim.status["phase"] == st.FAILED  # no wait and no restart cures it
    failed = st.condition(sim.status, st.FAILED)
    assert failed["reason"] == "ImagePullFailed"
    assert failed["message"].startswith(
        f"stage 1 (pod j-stage-1) cannot start: image {image!r} cannot be pulled"
        " (ErrImagePull: pull access denied for nope); use the trainer image"
    ), failed["message"]
    deleted = sorted(p["metadata"]["name"] for p in acts.delete)
    assert deleted == ["j-master-0", "j-stage-0", "j-stage-1"], deleted


def test_a_pod_waiting_for_its_config_is_named_in_the_pending_status():
    sim = Sim(stages=2)
    sim.reconcile()
    sim.set_phase("j-master-0", "Running")
    waiting(sim, "j-stage-1", "CreateContainerConfigError", 'secret "s" not found')
    acts = sim.reconcile()
    assert sim.status["phase"] == st.PENDING  # the secret may yet be created
    running = st.condition(sim.status, st.RUNNING)
    said = 'pod j-stage-1 cannot start: CreateContainerConfigError: secret "s" not found'
    assert running["status"] == "False" and running["reason"] == "PodCannotStart"
    assert running["message"] == said
    assert [(e.type, e.reason, e.message) for e in acts.events] == [
        ("Warning", "PodCannotStart", said)
    ]
    assert sim.reconcile().events == []  # said once


# ------------------------------------------------------------------- checkpoints, hostile


def manifest(checkpoint: dict, **spec) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "PipelineJob",
        "metadata": {"name": "j"},
        "spec": {"stages": 2, "checkpoint": checkpoint, **spec},
    }


def refusal(obj: dict, **kw) -> str:
    with pytest.raises(InvalidSpec) as e:
        parse(obj, **kw)
    return str(e.value)


@pytest.mark.parametrize("path", ["", "   "])
def test_an_empty_checkpoint_path_is_refused_naming_its_field(path):
    said = refusal(manifest({"path": path}))
    assert "spec.checkpoint.path: must name a directory" in said


def test_the_crd_refuses_an_empty_checkpoint_path_too():
    for text in crd.generated().values():
        schema = yaml.safe_load(text)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        path = schema["properties"]["spec"]["properties"]["checkpoint"]["properties"]["path"]
        assert path["pattern"] == r"^.*\S.*$"


VOLUME = {"volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": "c"}}]}


def test_a_checkpoint_on_no_volume_is_refused_on_a_cluster_saying_what_to_add():
    obj = manifest({"path": "/ckpt"})
    said = refusal(obj, cluster=True)
    assert "spec.checkpoint.path: '/ckpt' is on no volume: each of the job's 3 pods" in said
    assert "add checkpoint.volume" in said and "template.volumeMounts" in said
    assert parse(obj).spec["checkpoint"]["path"] == "/ckpt"  # the local runner: one filesystem
    relative = refusal(
        manifest(
            {"path": "ckpt"},
            template={**VOLUME, "volumeMounts": [{"name": "shared", "mountPath": "/work"}]},
        ),
        cluster=True,
    )
    assert "'ckpt' is on no volume" in relative  # a relative path is under no mount


@pytest.mark.parametrize(
    ("checkpoint", "mounts"),
    [
        ({"path": "/ckpt", "volume": "shared"}, []),
        ({"path": "/shared/run1/ckpt"}, [{"name": "shared", "mountPath": "/shared"}]),
        ({"path": "/shared"}, [{"name": "shared", "mountPath": "/shared/"}]),
    ],
)
def test_a_checkpoint_on_a_volume_passes_on_a_cluster(checkpoint, mounts):
    parse(manifest(checkpoint, template={**VOLUME, "volumeMounts": mounts}), cluster=True)


def test_a_mount_beside_the_path_is_no_volume_for_it():
    obj = manifest(
        {"path": "/shared-other"},
        template={**VOLUME, "volumeMounts": [{"name": "shared", "mountPath": "/shared"}]},
    )
    assert "is on no volume" in refusal(obj, cluster=True)


def test_the_operator_refuses_it_before_any_pod():
    sim = Sim(stages=2, checkpoint={"path": "/ckpt"})
    acts = sim.reconcile()
    assert sim.status["phase"] == st.FAILED and acts.create == [] and sim.pods == {}
    failed = st.condition(sim.status, st.FAILED)
    assert failed["reason"] == "InvalidSpec" and "spec.checkpoint.path" in failed["message"]


def test_render_refuses_it_and_validate_accepts_it_for_the_local_runner(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest({"path": "/ckpt"})))
    cli = [sys.executable, "-m", "pipejob.cli"]
    rendered = subprocess.run(
        [*cli, "render", str(path)], capture_output=True, text=True, timeout=50
    )
    assert rendered.returncode == 2 and "spec.checkpoint.path" in rendered.stderr
    assert "is on no volume" in rendered.stderr
    validated = subprocess.run(
        [*cli, "validate", str(path)], capture_output=True, text=True, timeout=50
    )
    assert validated.returncode == 0, validated.stderr
