"""Reading pods and writing phase and conditions (the status package), over plain dicts."""

from datetime import UTC, datetime, timedelta

import pytest

from pipejob.core.schema import apply
from pipejob.operator import status as st

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def pod(name="j-stage-1", phase="Running", **status):
    return {"metadata": {"name": name}, "status": {"phase": phase, **status}}


def terminated(exit_code, reason="Error", message="", finished="2025-01-02T03:04:05Z"):
    state = {"exitCode": exit_code, "reason": reason, "finishedAt": finished}
    if message:
        state["message"] = message
    return [{"name": "trainer", "state": {"terminated": state}}]


def test_failure_names_role_pod_exit_code_and_the_log_tail():
    failed = pod(
        phase="Failed",
        containerStatuses=terminated(3, message="RendezvousError: master unreachable"),
    )
    failure = st.pod_failure(failed, "stage 1")
    assert failure.reason == "PodFailed"
    assert failure.message == (
        "stage 1 (pod j-stage-1) failed with exit code 3 (Error): "
        "RendezvousError: master unreachable"
    )
    assert failure.at == "2025-01-02T03:04:05Z"


def test_failure_keeps_the_end_of_a_long_log():
    log = "x" * 1000 + "THE ERROR"
    failed = pod(phase="Failed", containerStatuses=terminated(1, message=log))
    message = st.pod_failure(failed, "master 0").message
    assert message.endswith("THE ERROR") and len(message) < 400


def test_eviction_is_its_own_reason():
    evicted = pod(phase="Failed", reason="Evicted", message="node low on memory")
    failure = st.pod_failure(evicted, "ps 0")
    assert failure.reason == "PodEvicted"
    assert "evicted: node low on memory" in failure.message


@pytest.mark.parametrize("phase", ["Pending", "Running", "Succeeded"])
def test_no_failure_unless_failed(phase):
    assert st.pod_failure(pod(phase=phase), "stage 0") is None


def test_role_counts():
    pods = [
        pod("a", "Running"),
        pod("b", "Pending"),
        pod("c", "Failed"),
        pod("d", "Running"),
        {"metadata": {"name": "e"}},
    ]
    roles = {"a": "stage", "b": "stage", "c": "stage", "d": "master", "e": "master"}
    counts = st.role_counts(pods, lambda p: roles[p["metadata"]["name"]])
    assert counts == {
        "stage": {"pending": 1, "running": 1, "succeeded": 0, "failed": 1},
        "master": {"pending": 1, "running": 1, "succeeded": 0, "failed": 0},
    }


def test_condition_transition_time_moves_only_when_status_flips():
    conds = st.set_condition([], "Created", True, "PodsCreated", "3 pods", T0)
    later = T0 + timedelta(minutes=5)
    same = st.set_condition(conds, "Created", True, "PodsCreated", "still 3", later)
    assert same[0]["lastTransitionTime"] == "2025-01-02T03:04:05Z"
    assert same[0]["message"] == "still 3"
    flipped = st.set_condition(same, "Created", False, "PodDeleted", "gone", later)
    assert flipped[0] == {
        "type": "Created",
        "status": "False",
        "reason": "PodDeleted",
        "message": "gone",
        "lastTransitionTime": "2025-01-02T03:09:05Z",
    }


def test_with_phase_sets_its_condition_and_clears_the_previous_one():
    running = st.with_phase({}, st.RUNNING, "AllPodsRunning", "3 running", T0)
    assert running["phase"] == "Running"
    assert st.is_true(running, "Running")
    done = st.with_phase(running, st.SUCCEEDED, "MasterSucceeded", "exit 0", T0)
    assert st.is_true(done, "Succeeded") and not st.is_true(done, "Running")
    assert done["completionTime"] == "2025-01-02T03:04:05Z"
    pending = st.with_phase(running, st.PENDING, "PodsPending", "0/3", T0)
    assert not st.is_true(pending, "Running") and pending["phase"] == "Pending"


def test_time_round_trip():
    assert st.parse_time(st.timestamp(T0)) == T0
    assert st.parse_time(None) is None


def test_status_schema_accepts_what_with_phase_writes_and_rejects_strays():
    status = st.with_phase(
        {"restarts": 1, "roles": {"master": {"running": 1}}},
        st.FAILED,
        "DeadlineExceeded",
        "too long",
        T0,
    )
    errors = []
    apply(st.STATUS, status, "status", errors)
    assert errors == []
    apply(st.STATUS, {"phase": "Done", "restart": 1}, "status", errors)
    assert {e.path for e in errors} == {"status.phase", "status.restart"}


def test_a_killed_pod_is_named_killed_by_its_signal():
    pod = {
        "metadata": {"name": "j-stage-1"},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "state": {
                        "terminated": {
                            "exitCode": 137,
                            "reason": "Error",
                            "message": "step 3/10 loss 2.1",
                        }
                    }
                }
            ],
        },
    }
    failure = st.pod_failure(pod, "stage 1")
    assert failure.message == (
        "stage 1 (pod j-stage-1) failed with exit code 137 (Error, killed by SIGKILL)"
    )
