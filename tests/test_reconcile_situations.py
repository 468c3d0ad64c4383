"""Each situation of operator/situations.py alone, over plain dicts: the job in it gets its
actions, a job not in it gets None. The jobs are walked there with test_reconcile's `Sim`;
test_reconcile.py follows the same situations through reconcile.decide, in their order."""

from __future__ import annotations

from datetime import timedelta

import pytest
from test_elastic_operator import ELASTIC, placed, unschedulable
from test_reconcile import IMAGE, Sim, started

from pipejob.core import contract
from pipejob.core.contract import ExitCode
from pipejob.operator import situations as sit
from pipejob.operator import status as st
from pipejob.operator.actions import Actions
from pipejob.operator.observation import Observed
from pipejob.operator.world_failures import CAUSE_GRACE

pytestmark = pytest.mark.timeout(30)


def seen(sim: Sim, later: timedelta = timedelta(seconds=1)) -> Observed:
    """What the next reconcile of `sim`'s job would observe, `later` from its last."""
    return Observed(sim.job, list(sim.pods.values()), sim.now + later, IMAGE)


def names(pods: list[dict]) -> list[str]:
    return sorted(p["metadata"]["name"] for p in pods)


def terminate(sim: Sim, name: str, code: int, message: str) -> None:
    """Pod `name` failed with exit code `code`, its termination message `message`."""
    sim.set_phase(name, "Failed", exit_code=code)
    sim.pods[name]["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = message


def test_the_order_of_precedence_is_one_list_whose_last_always_answers():
    assert [s.__name__ for s in sit.SITUATIONS] == [
        "finished",
        "invalid",
        "suspended",
        "succeeded",
        "past_deadline",
        "spec_changed",
        "preempted",
        "failed_permanently",
        "oom_killed",
        "failed",
        "resized",
        "starting_or_running",
    ]
    assert isinstance(sit.starting_or_running(seen(started(stages=2))), Actions)


@pytest.mark.parametrize("situation", sit.SITUATIONS[:-1], ids=lambda s: s.__name__)
def test_a_running_world_is_in_no_other_situation(situation):
    assert situation(seen(started(stages=2, activeDeadlineSeconds=60))) is None


def test_finished_stops_running_pods_keeps_the_rest_and_deletes_the_job_after_its_ttl():
    sim = started(stages=2, ttlSecondsAfterFinished=100)
    sim.set_phase("j-master-0", "Succeeded", 0)
    sim.job["status"] = sit.succeeded(seen(sim, timedelta(0))).status  # its stages still run
    acts = sit.finished(seen(sim))
    assert names(acts.delete) == ["j-stage-0", "j-stage-1"] and not acts.delete_job
    assert acts.status["phase"] == st.SUCCEEDED and acts.events == []
    assert sit.finished(seen(sim, timedelta(seconds=100))).delete_job


def test_finished_lets_an_edited_invalid_spec_be_looked_at_again():
    sim = Sim(stages=2, batchSize=30, microBatches=4)
    sim.reconcile()
    assert sit.finished(seen(sim)) is not None
    sim.job["metadata"]["generation"] = 2
    assert sit.finished(seen(sim)) is None


def test_invalid_fails_the_job_with_the_field_path():
    sim = Sim(stages=2, batchSize=30, microBatches=4)
    acts = sit.invalid(seen(sim))
    failed = st.condition(acts.status, st.FAILED)
    assert acts.status["phase"] == st.FAILED and failed["reason"] == "InvalidSpec"
    assert "spec.microBatches" in failed["message"] and acts.create == []
    assert sit.invalid(seen(Sim(stages=2))) is None


def test_suspended_removes_every_pod_and_the_start_time():
    sim = started(stages=2)
    sim.job["spec"]["suspend"] = True
    acts = sit.suspended(seen(sim))
    assert len(acts.delete) == 3 and "startTime" not in acts.status
    assert acts.status["phase"] == st.SUSPENDED and not st.is_true(acts.status, st.CREATED)


def test_succeeded_when_the_master_exits_0_with_its_last_step():
    sim = started(stages=2, steps=5)
    sim.set_phase("j-master-0", "Succeeded", 0)
    acts = sit.succeeded(seen(sim))
    assert acts.status["phase"] == st.SUCCEEDED and acts.status["progress"] == "5/5"
    assert names(acts.delete) == ["j-stage-0", "j-stage-1"]


def test_past_deadline_fails_the_job_once_active_longer_than_its_deadline():
    sim = started(stages=2, activeDeadlineSeconds=60)
    assert sit.past_deadline(seen(sim, timedelta(seconds=57))) is None
    acts = sit.past_deadline(seen(sim, timedelta(seconds=60)))
    assert st.condition(acts.status, st.FAILED)["reason"] == "DeadlineExceeded"
    assert len(acts.delete) == 3


def test_spec_changed_recreates_the_world_without_a_restart():
    sim = started(stages=2)
    sim.job["spec"]["stages"] = 3
    acts = sit.spec_changed(seen(sim))
    assert len(acts.delete) == 3 and acts.status["phase"] == st.PENDING
    assert acts.status["restarts"] == 0 and [e.reason for e in acts.events] == ["SpecChanged"]
    sim.job["spec"].update(stages=2, backoffLimit=5)  # a run control: the same world
    assert sit.spec_changed(seen(sim)) is None


def test_preempted_counts_a_preemption_not_a_restart():
    sim = started(stages=2, backoffLimit=0)
    sim.pods["j-stage-1"]["status"]["conditions"] = [
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}
    ]
    acts = sit.preempted(seen(sim))
    assert acts.status["phase"] == st.RESTARTING and acts.status["preemptions"] == 1
    assert acts.status["restarts"] == 0 and len(acts.delete) == 3


def test_failed_permanently_fails_at_once_with_the_trainers_reason():
    sim = started(stages=2, backoffLimit=3)
    message = contract.permanent_message("ShapeMismatch", "training failed: shapes")
    terminate(sim, "j-master-0", ExitCode.PERMANENT, message)
    acts = sit.failed_permanently(seen(sim))
    assert st.condition(acts.status, st.FAILED)["reason"] == "ShapeMismatch"
    assert acts.status["restarts"] == 0 and names(acts.delete) == ["j-stage-0", "j-stage-1"]


@pytest.mark.parametrize("limit", [1, 0])
def test_failed_restarts_the_world_until_the_backoff_limit_is_spent(limit):
    sim = started(stages=2, backoffLimit=limit)
    sim.set_phase("j-stage-1", "Failed", 137)
    acts = sit.failed(seen(sim))
    if limit:
        assert acts.status["phase"] == st.RESTARTING and acts.status["restarts"] == 1
        assert len(acts.delete) == 3
    else:
        assert st.condition(acts.status, st.FAILED)["reason"] == "BackoffLimitExceeded"
        assert names(acts.delete) == ["j-master-0", "j-stage-0"]  # the failed pod stays


def test_failed_waits_a_moment_for_the_cause_of_a_pod_that_only_lost_a_peer():
    sim = started(stages=2)
    terminate(sim, "j-stage-0", 1, f"{contract.BROKEN_PREFIX} lost stage 1")
    finished = st.parse_time("2025-01-02T03:05:00Z")
    assert sit.failed(seen(sim, finished - sim.now)) is None  # the others still run
    grace = finished + CAUSE_GRACE - sim.now
    assert sit.failed(seen(sim, grace)).status["phase"] == st.RESTARTING


def test_resized_restarts_an_elastic_world_at_the_size_that_fits():
    sim = Sim(**ELASTIC)
    sim.reconcile()
    placed(sim, "j-master-0", "j-r0-stage-0", "j-r0-stage-1", phase="Running")
    unschedulable(sim, "j-r1-stage-0")
    unschedulable(sim, "j-r1-stage-1")
    assert sit.resized(seen(sim, timedelta(seconds=59))) is None
    acts = sit.resized(seen(sim, timedelta(seconds=61)))
    assert acts.status["replicas"] == 1 and acts.status["resizes"] == 1
    assert acts.status["phase"] == st.RESTARTING and len(acts.delete) == 5


def test_starting_or_running_makes_the_world_then_says_it_runs():
    sim = Sim(stages=2)
    acts = sit.starting_or_running(seen(sim))
    assert names(acts.create) == ["j-master-0"]  # first, alone: test_master_check.py
    assert acts.service is not None and acts.status["phase"] == st.PENDING
    sim.reconcile()  # its master passes its check: the others are made
    for name in sim.pods:
        sim.set_phase(name, "Running")
    acts = sit.starting_or_running(seen(sim))
    assert acts.create == [] and acts.status["phase"] == st.RUNNING
