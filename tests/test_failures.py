"""Failures no validation can see (issue 11, group 6): the trainer tells permanent failures
(configuration: a restart would repeat them) from retryable ones, and the operator fails a
job at once on a permanent one, without spending backoffLimit."""

from __future__ import annotations

import pytest
from test_reconcile import Sim

from pipejob.core import contract
from pipejob.core.contract import ExitCode
from pipejob.operator import kube, reconcile
from pipejob.operator import status as st
from pipejob.trainer.runtime.failures import permanent_reason
from pipejob.trainer.runtime.world import ContractError, RendezvousError

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ModuleNotFoundError("No module named 'mymodels'"), "ImportFailed"),
        (ImportError("cannot import name 'Net' from 'mymodels'"), "ImportFailed"),
        (
            RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x512 and 2048x10)"),
            "ShapeMismatch",
        ),
        (
            RuntimeError(
                "On WorkerInfo(id=1, name=stage0):\nRuntimeError('Given groups=1, weight"
                " of size [64, 3, 7, 7], expected input[2, 1, 32, 32]')"
            ),
            "ShapeMismatch",
        ),
        (ValueError("Expected more than 1 value per channel when training"), "ShapeMismatch"),
        (ValueError("invalid literal for int()"), "InvalidConfiguration"),
        (TypeError("unsupported operand"), "InvalidConfiguration"),
        (ContractError("PIPEJOB_SPEC is not the job's spec"), "BadEnvironment"),
        (RuntimeError("connection reset by peer"), None),
        (RendezvousError("the RPC world did not form"), None),
        (OSError("No space left on device"), None),
    ],
)
def test_the_trainer_tells_permanent_from_retryable(error, reason):
    assert permanent_reason(error) == reason


def test_a_permanent_message_reads_back():
    said = "training failed: RuntimeError: x: y"
    line = contract.permanent_message("ShapeMismatch", said)
    assert line.startswith(contract.PERMANENT_PREFIX)
    assert contract.parse_permanent(line) == ("ShapeMismatch", said)
    assert contract.parse_permanent("training failed: x") is None
    assert contract.parse_permanent("permanent: NoSuchReason: x") is None


def fail(sim: Sim, name: str, code: int, message: str) -> None:
    sim.set_phase(name, "Failed", exit_code=code)
    sim.pods[name]["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = message


def test_a_permanent_failure_fails_the_job_at_once_with_the_trainers_reason():
    sim = Sim(stages=2, backoffLimit=3)
    sim.reconcile()
    sim.run_all()
    message = contract.permanent_message(
        "ShapeMismatch", "training failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    )
    fail(sim, "j-master-0", ExitCode.PERMANENT, message)
    sim.set_phase("j-stage-1", "Failed", exit_code=1, finished="2025-01-02T03:06:00Z")
    acts = sim.reconcile()
    assert sim.status["phase"] == st.FAILED and sim.status["restarts"] == 0
    failed = st.condition(sim.status, st.FAILED)
    assert failed["reason"] == "ShapeMismatch"
    assert "master 0 (pod j-master-0) failed permanently with exit code 5" in failed["message"]
    assert "mat1 and mat2 shapes cannot be multiplied" in failed["message"]
    assert acts.create == [] and ("Warning", "ShapeMismatch") in sim.events()
    sim.reconcile()  # and it stays failed: no world is made again
    assert sim.status["phase"] == st.FAILED and sim.acts.create == []


def test_a_bad_environment_is_permanent_too():
    sim = Sim("HybridJob", trainers=1)
    sim.reconcile()
    message = contract.permanent_message("BadEnvironment", "bad environment: RANK unset")
    fail(sim, "j-ps-0", ExitCode.BAD_ENVIRONMENT, message)
    sim.reconcile()
    assert sim.status["phase"] == st.FAILED and sim.status["restarts"] == 0
    assert st.condition(sim.status, st.FAILED)["reason"] == "BadEnvironment"


def test_an_exit_code_5_without_its_message_still_fails_the_job():
    sim = Sim(stages=2)
    sim.reconcile()
    fail(sim, "j-stage-0", ExitCode.PERMANENT, "")
    sim.reconcile()
    assert st.condition(sim.status, st.FAILED)["reason"] == "PermanentFailure"


def test_a_retryable_failure_still_restarts_the_world():
    sim = Sim(stages=2, backoffLimit=3)
    sim.reconcile()
    sim.run_all()
    fail(sim, "j-stage-0", ExitCode.TRAINING_FAILED, "training failed: RuntimeError: reset")
    sim.reconcile()
    assert sim.status["phase"] == st.RESTARTING and sim.status["restarts"] == 1


def test_a_spec_only_the_operator_refuses_makes_no_pod():
    volumes = [{"name": "root", "hostPath": {"path": "/"}}]
    sim = Sim(stages=2, template={"volumes": volumes})
    acts = sim.reconcile()
    assert sim.status["phase"] == st.FAILED and acts.create == [] and sim.pods == {}
    failed = st.condition(sim.status, st.FAILED)
    assert (
        failed["reason"] == "InvalidSpec"
        and "spec.template.volumes[0].hostPath" in (failed["message"])
    )
    allowed = reconcile.decide(
        sim.job | {"status": {}}, [], sim.now, "img", allow_node_volumes=True
    )
    # An operator that allows node volumes makes the world, its master first (master_check.py)
    assert [kube.role_of(p) for p in allowed.create] == ["master"]
