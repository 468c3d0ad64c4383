"""Elastic worlds in the operator's decision (reconcile.decide, operator/elastic_world.py), over
plain dicts: the size a world starts at, when it restarts smaller (pods unschedulable for
elastic.pendingSeconds, or a gang left unadmitted) and larger (its standby pods run and a
checkpoint is written after), what the status, the conditions and the Events say, and what
Kueue and Volcano are given at each size. The emulated cluster runs it for real in
test_elastic_e2e.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from test_reconcile import Sim

from pipejob.core.spec import InvalidSpec, parse
from pipejob.operator import elastic_world, kube
from pipejob.operator import status as st

pytestmark = pytest.mark.timeout(30)

CKPT = {"path": "/ckpt", "everySteps": 2, "volume": "ckpt"}
VOLUMES = {"volumes": [{"name": "ckpt", "emptyDir": {}}]}
ELASTIC = {
    "stages": 2,
    "replicas": {"min": 1, "max": 2},
    "checkpoint": CKPT,
    "template": VOLUMES,
    "elastic": {"pendingSeconds": 60},
}
NO_ROOM = "0/1 nodes are available: 1 Insufficient cpu."


def unschedulable(sim: Sim, name: str) -> None:
    pod = sim.pods[name]
    pod["spec"].pop("nodeName", None)
    pod["status"] = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": NO_ROOM,
                "lastTransitionTime": st.timestamp(sim.now),
            }
        ],
    }


def placed(sim: Sim, *names: str, phase: str = "Pending") -> None:
    for name in names:
        sim.pods[name]["spec"]["nodeName"] = "node-1"
        sim.pods[name]["status"] = {"phase": phase, "startTime": st.timestamp(sim.now)}


def world(sim: Sim) -> list[str]:
    return sorted(n for n, p in sim.pods.items() if not elastic_world.is_standby(p))


def standby(sim: Sim) -> list[str]:
    return sorted(n for n, p in sim.pods.items() if elastic_world.is_standby(p))


def shrunk_to_one(sim: Sim) -> None:
    """The 2-replica world of `sim` with replica 1's stages unschedulable past pendingSeconds."""
    sim.reconcile()
    assert sim.status["replicas"] == 2 and len(world(sim)) == 5  # the largest, at first
    placed(sim, "j-master-0", "j-r0-stage-0", "j-r0-stage-1", phase="Running")
    unschedulable(sim, "j-r1-stage-0")
    unschedulable(sim, "j-r1-stage-1")
    sim.reconcile(seconds=59)
    assert sim.status["replicas"] == 2 and sim.acts.delete == []  # not yet
    sim.reconcile(seconds=2)


def test_an_elastic_size_needs_a_checkpoint_and_min_at_most_max():
    with pytest.raises(
        InvalidSpec, match="spec.replicas: an elastic replicas .* needs spec.checkpoint"
    ):
        parse(
            {
                "apiVersion": "pipejob.dev/v1alpha1",
                "kind": "PipelineJob",
                "metadata": {"name": "j"},
                "spec": {"replicas": {"max": 2}},
            }
        )
    with pytest.raises(InvalidSpec, match="spec.trainers.min: min must be at most max"):
        parse(
            {
                "apiVersion": "pipejob.dev/v1alpha1",
                "kind": "HybridJob",
                "metadata": {"name": "j"},
                "spec": {"trainers": {"min": 3, "max": 2}},
            }
        )


def test_pods_unschedulable_past_pending_seconds_restart_the_world_at_the_size_that_fits():
    sim = Sim(**ELASTIC)
    shrunk_to_one(sim)
    message = f"scaled from 2 to 1 replicas: 2 pods Pending: Unschedulable: {NO_ROOM}"
    assert sim.events() == [("Warning", "ScaledDown")] and sim.acts.events[0].message == message
    assert sim.status["phase"] == "Restarting" and sim.status["replicas"] == 1
    assert (sim.status["restarts"], sim.status["resizes"]) == (0, 1)  # no backoffLimit spent
    assert st.condition(sim.status, "Resized")["message"] == message
    assert sim.pods == {}  # the whole world goes
    sim.reconcile()
    assert world(sim) == ["j-master-0", "j-stage-0", "j-stage-1"]  # one pipeline now
    assert {p["metadata"]["labels"][kube.RESTART_LABEL] for p in sim.pods.values()} == {"1"}
    assert standby(sim) == []  # not while the world is not running yet


def test_a_world_never_shrinks_below_min_and_steps_down_where_its_master_has_no_room():
    # (elastic on a fixed size, min == max, is refused before any pod: test_field_refusals.py)
    sim = Sim(**ELASTIC)
    sim.reconcile()
    for name in world(sim):  # the master too: a replica's room may be what it needs
        unschedulable(sim, name)
    sim.reconcile(seconds=600)
    assert sim.status["replicas"] == 1 and sim.events() == [("Warning", "ScaledDown")]
    sim.reconcile()
    for name in world(sim):
        unschedulable(sim, name)
    sim.reconcile(seconds=600)
    assert sim.status["replicas"] == 1 and sim.acts.delete == []  # min


def test_standby_pods_hold_the_missing_replica_s_place_and_it_grows_back_at_a_checkpoint():
    sim = Sim(**ELASTIC | {"template": VOLUMES | {"resources": {"requests": {"cpu": "1"}}}})
    shrunk_to_one(sim)
    sim.reconcile()
    sim.run_all()
    assert sim.status["phase"] == "Running"
    sim.reconcile()
    assert standby(sim) == ["j-standby-1-0", "j-standby-1-1"]  # replica 1's two stages
    pod = sim.pods["j-standby-1-0"]
    stage = sim.pods["j-stage-0"]["spec"]["containers"][0]
    container = pod["spec"]["containers"][0]
    assert container["command"] == elastic_world.STANDBY_COMMAND and "env" not in container
    assert container["resources"] == stage["resources"]  # the room a stage needs
    assert pod["metadata"]["labels"][elastic_world.JOINS_LABEL] == "2"
    assert sim.status["roles"]["stage"]["running"] == 2  # standby pods are not the world's

    training = {"checkpointStep": 6, "checkpointTime": st.timestamp(sim.now)}
    sim.job["status"]["training"] = training
    placed(sim, *standby(sim), phase="Running")
    sim.reconcile()
    assert sim.status["replicas"] == 1  # room again, but no checkpoint since
    later = sim.now + timedelta(seconds=5)
    sim.job["status"]["training"] = {"checkpointStep": 8, "checkpointTime": st.timestamp(later)}
    sim.reconcile(seconds=10)
    assert sim.events() == [("Normal", "ScaledUp")]
    assert sim.acts.events[0].message == (
        "scaled from 1 to 2 replicas: 2 standby pods run"
        " (capacity returned); resuming from the checkpoint"
        " of step 8"
    )
    assert sim.status["replicas"] == 2 and sim.status["resizes"] == 2 and sim.pods == {}
    sim.reconcile()
    assert len(world(sim)) == 5 and standby(sim) == []


def test_a_standby_pod_that_fails_is_no_failure_of_the_world():
    sim = Sim(**ELASTIC)
    shrunk_to_one(sim)
    sim.reconcile()
    sim.run_all()
    sim.reconcile()
    sim.set_phase("j-standby-1-0", "Failed", 137)
    sim.reconcile()
    assert sim.status["phase"] == "Running" and sim.status["restarts"] == 0


def test_a_hybrid_job_shrinks_to_the_trainers_that_were_placed():
    sim = Sim("HybridJob", trainers={"min": 1, "max": 3}, checkpoint=CKPT, template=VOLUMES)
    sim.reconcile()
    assert sim.status["trainers"] == 3
    placed(sim, "j-master-0", "j-ps-0", "j-trainer-0", "j-trainer-1")
    unschedulable(sim, "j-trainer-2")
    sim.reconcile(seconds=200)  # pendingSeconds' default, 120
    assert sim.status["trainers"] == 2
    assert sim.acts.events[0].message.startswith("scaled from 3 to 2 trainers: 1 pods Pending")


def test_a_fixed_size_reports_its_size_and_never_resizes():
    sim = Sim("HybridJob", trainers=2)
    sim.reconcile()
    assert sim.status["trainers"] == 2
    unschedulable(sim, "j-trainer-1")
    sim.reconcile(seconds=600)
    assert sim.status["trainers"] == 2 and not sim.status.get("resizes")


def test_kueue_admits_each_size_as_a_group_of_its_own_and_the_old_one_ends():
    sim = Sim(**ELASTIC | {"scheduling": {"provider": "kueue", "queue": "team-a"}})
    sim.reconcile()
    assert {kueue_group(p) for p in sim.pods.values()} == {("j", "5")}
    for pod in sim.pods.values():  # gated by Kueue's webhook, never admitted
        pod["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    sim.reconcile()
    assert sim.status["phase"] == "Queued"
    sim.reconcile(seconds=61)
    assert sim.events() == [("Warning", "ScaledDown")]
    said = sim.acts.events[0].message
    assert said.startswith(
        "scaled from 2 to 1 replicas: not admitted in 60s: Kueue has not admitted pod group j"
    )
    assert len(sim.acts.end_group) == 5  # Kueue frees the 5-pod group's quota
    sim.reconcile()
    assert {kueue_group(p) for p in sim.pods.values()} == {("j-1", "3")}


def kueue_group(pod: dict) -> tuple[str, str]:
    meta = pod["metadata"]
    return (
        meta["labels"]["kueue.x-k8s.io/pod-group-name"],
        meta["annotations"]["kueue.x-k8s.io/pod-group-total-count"],
    )


def test_volcano_s_podgroup_follows_the_world_s_size():
    sim = Sim(**ELASTIC | {"scheduling": {"provider": "volcano"}})
    sim.reconcile()
    assert sim.acts.podgroup["spec"]["minMember"] == 5
    sim.reconcile()
    sim.job["status"] = st.with_phase(
        sim.status, "Queued", "WaitingForAdmission", "waiting", sim.now
    )
    sim.reconcile(seconds=61)
    assert sim.events() == [("Warning", "ScaledDown")]
    sim.reconcile()
    group = sim.acts.podgroup
    assert group["spec"]["minMember"] == 3 and group["metadata"]["name"] == "j"  # updated
