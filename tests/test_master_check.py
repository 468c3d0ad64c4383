"""The operator's master-first order (operator/master_check.py), decided in process: with no
gang scheduler, a PipelineJob's world is its Service and master first, and its other pods
once a poll of the master's /progress finds it past its own check; a master that refuses
fails the job with no other pod ever made. The real operator's: test_operator_refusals_e2e."""

from __future__ import annotations

from datetime import timedelta

import pytest
from test_failures import fail
from test_reconcile import Sim

from pipejob.core import contract, master_first
from pipejob.core.contract import ExitCode, Progress
from pipejob.core.plan import plan_world
from pipejob.core.spec import API_VERSION, parse
from pipejob.operator import kube, master_check, reconcile
from pipejob.operator import status as st
from pipejob.trainer.runtime.world import read_env

pytestmark = pytest.mark.timeout(30)

# The trainer's verdict as it words it: longer than a log tail's 300 characters, and kept whole.
REFUSAL = (
    "training failed: ValueError: spec.loss: the model returns ((2, 1, 64) float32, None): the"
    " default loss (cross-entropy) needs logits: a tensor or a dict with 'logits', not a tuple;"
    " give spec.loss: {import: mypkg.losses:build}, a factory of a callable (outputs, labels) ->"
    " the batch's mean loss, which takes this output as the model returns it (at shape_check.py:55"
    " in fits_model)"
)


def report(phase: str) -> Progress:
    return Progress(step=0, steps=1, phase=phase)


def polled(sim: Sim, phase: str | None, **later):
    """A reconcile of `sim` whose poll of the master found it in `phase` (None: not polled)."""
    sim.checks = False
    sim.now += timedelta(**later) if later else timedelta(seconds=1)
    pods = list(sim.pods.values())
    progress = None if phase is None else report(phase)
    acts = reconcile.decide(sim.job, pods, sim.now, "img", progress)
    for pod in acts.create:
        sim.pods[pod["metadata"]["name"]] = dict(pod, status={"phase": "Pending"})
    sim.job["status"] = acts.status
    sim.acts = acts
    return acts


def running_master(sim: Sim, started: str = "2025-01-02T03:04:06Z") -> None:
    sim.pods["j-master-0"]["metadata"]["creationTimestamp"] = "2025-01-02T03:04:06Z"
    sim.pods["j-master-0"]["status"] = {
        "phase": "Running",
        "containerStatuses": [{"name": "trainer", "state": {"running": {"startedAt": started}}}],
    }


def env(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_the_service_and_the_master_come_first_and_the_others_once_it_has_checked():
    sim = Sim(stages=2, checks=False)
    acts = polled(sim, None)
    assert acts.service["metadata"]["name"] == "j"
    assert sorted(sim.pods) == ["j-master-0"]
    assert env(sim.pods["j-master-0"])[contract.MASTER_FIRST] == master_first.PODS
    assert sim.status["phase"] == st.PENDING and not st.is_true(sim.status, st.CREATED)
    pending = [e.message for e in acts.events if e.reason == "PodsPending"]
    assert pending == [f"0/3 pods running; {master_check.WAITING}"]
    running_master(sim)
    for phase in (None, "starting", "failed"):  # not polled, checking, refusing
        acts = polled(sim, phase)
        assert acts.create == [] and sorted(sim.pods) == ["j-master-0"], phase
    acts = polled(sim, "preflight")
    assert sorted(p["metadata"]["name"] for p in acts.create) == ["j-stage-0", "j-stage-1"]
    assert all(env(p)[contract.MASTER_FIRST] == master_first.PODS for p in acts.create)
    assert st.is_true(sim.status, st.CREATED)
    assert polled(sim, None).create == []  # level-based: the others exist, nothing waits


def test_a_master_that_refuses_fails_the_job_and_no_other_pod_is_ever_made():
    sim = Sim(stages=2, checks=False, backoffLimit=3)
    polled(sim, None)
    running_master(sim)
    polled(sim, "starting")
    fail(
        sim,
        "j-master-0",
        ExitCode.PERMANENT,
        contract.permanent_message("InvalidConfiguration", REFUSAL),
    )
    acts = polled(sim, None)
    assert sim.status["phase"] == st.FAILED and sim.status["restarts"] == 0
    failed = st.condition(sim.status, st.FAILED)
    assert failed["reason"] == "InvalidConfiguration"
    assert failed["message"].endswith(f"failed permanently with exit code 5: {REFUSAL}")
    assert [e.message for e in acts.events if e.reason == "InvalidConfiguration"] == [
        failed["message"]
    ]
    assert acts.create == [] and acts.delete == []
    for _ in range(3):  # and stays so
        assert polled(sim, None, seconds=30).create == []
    assert sorted(sim.pods) == ["j-master-0"]


def test_a_restarted_world_starts_its_master_first_too():
    sim = Sim(stages=2, checks=False, backoffLimit=3)
    polled(sim, None)
    running_master(sim)
    polled(sim, "training")
    fail(sim, "j-stage-0", ExitCode.TRAINING_FAILED, "training failed: RuntimeError: reset")
    polled(sim, None)
    assert sim.status["phase"] == st.RESTARTING and sim.status["restarts"] == 1
    sim.pods.clear()  # the old world's pods have gone
    polled(sim, None)
    assert sorted(sim.pods) == ["j-master-0"]
    assert kube.restart_of(sim.pods["j-master-0"]) == 1
    running_master(sim, "2025-01-02T03:04:20Z")
    assert polled(sim, "starting").create == []
    assert len(polled(sim, "preflight").create) == 2


def test_a_master_the_operator_cannot_read_gets_its_others_after_unread_seconds():
    sim = Sim(stages=2, checks=False)
    polled(sim, None)
    running_master(sim, st.timestamp(sim.now))
    assert polled(sim, None, seconds=master_check.UNREAD_SECONDS - 5).create == []
    assert len(polled(sim, None, seconds=10).create) == 2  # no report of it was ever read


def test_a_master_read_once_is_waited_for_however_long_its_check_takes():
    sim = Sim(stages=2, checks=False)
    polled(sim, None)
    running_master(sim, st.timestamp(sim.now))
    polled(sim, "starting")  # read: status.training is its report
    assert polled(sim, None, seconds=10 * master_check.UNREAD_SECONDS).create == []


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("PipelineJob", {"stages": 2, "scheduling": {"provider": "volcano"}}),
        ("PipelineJob", {"stages": 2, "scheduling": {"provider": "coscheduling"}}),
        ("HybridJob", {"trainers": 2}),  # its master checks nothing alone
    ],
)
def test_a_gang_scheduled_world_or_another_kind_is_made_whole(kind, spec):
    sim = Sim(kind, checks=False, **spec)
    acts = polled(sim, None)
    assert len(acts.create) == len(sim.pods) > 2
    assert all(contract.MASTER_FIRST not in env(p) for p in acts.create)


@pytest.mark.parametrize(
    ("how", "first", "after"),
    [(master_first.PODS, True, 5.0 + 120), (master_first.PROCESSES, True, 5.0), (None, False, 5.0)],
)
def test_the_master_allows_pods_made_after_its_check_the_rendezvous_timeout(how, first, after):
    """What the operator tells the master (kube.world) is what the trainer reads: where the
    others' pods are made only after its check, its wait for their check-in (preflight's
    `late`) allows rendezvousTimeoutSeconds more for their scheduling and image pulls."""
    job = parse(
        {"apiVersion": API_VERSION, "kind": "PipelineJob", "metadata": {"name": "j"}}
        | {"spec": {"stages": 2, "rendezvousTimeoutSeconds": 120}},
        "j",
    )
    pods = kube.world(job, 0, "ns")
    processes = plan_world(job, kube.addresser(job))
    if how is not None:
        processes = master_first.told(processes, how)
        assert env(pods[0])[contract.MASTER_FIRST] == master_first.PODS
    master = read_env(processes[0].env)
    assert master.master_first is first and master.others_after(5.0) == after


def test_an_edited_spec_s_new_world_waits_for_its_master_while_old_pods_terminate():
    """The old world's stage still terminating (same names, same world number) is no sign
    that the new master has checked: only the new master is made, once its name is free."""
    sim = Sim(stages=2, checks=False)
    polled(sim, None)
    running_master(sim)
    polled(sim, "training")
    sim.job["spec"]["stages"] = 3
    sim.job["metadata"]["generation"] = 2
    assert len(polled(sim, None).delete) == 3
    for pod in sim.pods.values():
        pod["metadata"]["deletionTimestamp"] = "2025-01-02T03:05:00Z"
    del sim.pods["j-master-0"]  # gone first; stage 1 terminating, as are the others
    acts = polled(sim, None)
    assert [p["metadata"]["name"] for p in acts.create] == ["j-master-0"]
    assert kube.spec_hash_of(acts.create[0]) == kube.spec_hash(parse(sim.job))
