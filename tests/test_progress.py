"""Live progress: reading a master's /progress over HTTP (progress.py), and how reports,
termination messages and success show in the job's status (reconcile.decide, the status package).

The HTTP tests run a stand-in master on loopback (the real one is trainer/monitor.py, used
by tests/test_operator_progress_e2e.py): the boundary here is HTTP, not the trainer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from harness.standin import StandInMaster
from pipejob.core.contract import MAX_MESSAGE, PreflightResult, Progress
from pipejob.core.schema import apply
from pipejob.core.spec import API_VERSION, parse
from pipejob.operator import kube, progress, reconcile
from pipejob.operator import status as st

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
REPORT = {
    "phase": "training",
    "step": 3,
    "steps": 20,
    "loss": 2.25,
    "samplesPerSecond": 41.5,
    "bubble": 0.31,
    "resumedFromStep": None,
    "preflight": {"ok": True, "message": "3 links ok"},
    "message": None,
}


# --- parse ------------------------------------------------------------------------------


def test_a_report_keeps_the_fields_the_status_shows():
    assert Progress.parse(REPORT) == Progress(
        phase="training",
        step=3,
        steps=20,
        loss=2.25,
        samplesPerSecond=41.5,
        bubble=0.31,
        preflight=PreflightResult(True, "3 links ok"),
    )
    resumed = Progress.parse(REPORT | {"resumedFromStep": 10, "step": 12, "loss": 1})
    assert resumed.resumedFromStep == 10 and resumed.loss == 1.0


@pytest.mark.parametrize(
    "data",
    [
        [],
        "3/20",
        {"steps": 20},
        {"step": -1, "steps": 20},
        {"step": True, "steps": 20},
        {"step": 1.5, "steps": 20},
    ],
)
def test_something_else_than_a_report_is_refused(data):
    with pytest.raises(ValueError):
        Progress.parse(data)


def test_a_report_keeps_the_last_evaluation():
    evaluated = REPORT | {"evalStep": 3, "evalLoss": 2, "evalAccuracy": 0.5, "evalPerplexity": None}
    report = Progress.parse(evaluated)
    assert (report.evalStep, report.evalLoss, report.evalAccuracy) == (3, 2.0, 0.5)
    assert report.evalPerplexity is None
    assert isinstance(report.evalLoss, float)
    odd = Progress.parse(
        REPORT
        | {"evalStep": -1, "evalLoss": "low", "evalAccuracy": True, "evalPerplexity": float("inf")}
    )
    assert odd == Progress.parse(REPORT)  # each counts as absent


def test_a_report_keeps_each_members_peak_memory_and_drops_what_is_not_one():
    memory = {
        "master": {"rssPeakBytes": 5 << 20},
        "stage0": {"rssPeakBytes": 7 << 20, "cudaPeakBytes": 3 << 20},
    }
    odd = {
        "stage1": {"rssPeakBytes": -1},
        "stage2": {"rssPeakBytes": 1.5},
        "stage3": "big",
        "stage4": {"rssPeakBytes": 9, "swapBytes": 4},
    }
    report = Progress.parse(REPORT | {"memory": memory | odd})
    assert report.memory == memory | {"stage4": {"rssPeakBytes": 9}}
    assert Progress.parse(REPORT | {"memory": ["master"]}).memory is None
    assert Progress.parse(REPORT | {"memory": {"stage1": {"rssPeakBytes": True}}}).memory is None


def test_unknown_or_ill_typed_figures_count_as_absent():
    odd = {
        "step": 1,
        "steps": 2,
        "phase": "dancing",
        "loss": float("nan"),
        "bubble": "high",
        "samplesPerSecond": True,
        "resumedFromStep": -3,
        "preflight": {"ok": "yes"},
        "message": "x" * 1000,
    }
    report = Progress.parse(odd)
    assert report == Progress(step=1, steps=2, message="x" * MAX_MESSAGE)


# --- which pod --------------------------------------------------------------------------


def job_manifest(**spec) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "PipelineJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "uid-1", "generation": 1},
        "spec": {"steps": 20, **spec},
    }


def pods_of(manifest: dict, restart: int = 0, phase: str = "Running") -> list[dict]:
    """The job's world as a kubelet would report it: running, each pod with its podIP."""
    job = parse(manifest)
    pods = kube.world(job, restart, "ns", kube.owner_reference(manifest), "img")
    for i, pod in enumerate(pods):
        pod["metadata"]["uid"] = f"pod-{restart}-{i}"
        pod["status"] = {"phase": phase, "podIP": f"10.0.{restart}.{i + 1}"}
    return pods


def test_the_url_is_the_running_master_of_the_current_world():
    old, new = pods_of(job_manifest()), pods_of(job_manifest(), restart=1)
    assert progress.url(new, 1) == "http://10.0.1.1:29503/progress"
    assert progress.url(old + new, 1) == "http://10.0.1.1:29503/progress"
    assert progress.url(old, 1) is None  # an older world's master says nothing of this one
    assert progress.url(pods_of(job_manifest(), phase="Pending"), 0) is None
    gone = pods_of(job_manifest())
    gone[0]["metadata"]["deletionTimestamp"] = "2025-01-02T03:04:05Z"
    assert progress.url(gone, 0) is None
    ipv6 = pods_of(job_manifest())
    ipv6[0]["status"]["podIP"] = "fd00::5"
    assert progress.url(ipv6, 0) == "http://[fd00::5]:29503/progress"


# --- fetch over HTTP --------------------------------------------------------------------


@pytest.fixture
def master() -> Iterator[StandInMaster]:
    standin = StandInMaster()
    standin.answer(REPORT)
    yield standin
    standin.close()


def test_fetch_reads_and_parses_the_report(master):
    assert progress.fetch(master.url) == Progress.parse(REPORT)


@pytest.mark.parametrize(
    "reply",
    [
        (404, b"no"),
        (500, b"{}"),
        (200, b"not json"),
        (200, b'{"step": "3"}'),
        (200, b"\xff\xfe"),
        (200, b"[" * (progress.MAX_BYTES + 1)),
    ],
)
def test_a_bad_answer_is_no_report(master, reply):
    master.reply = reply
    assert progress.fetch(master.url) is None


def test_a_slow_master_is_no_report_after_the_timeout(master):
    master.delay = 2.0  # then it answers a good report: None means fetch gave up first
    assert progress.fetch(master.url, timeout=0.3) is None


def test_nobody_listening_is_no_report():
    standin = StandInMaster()
    standin.close()  # its port is free once closed
    assert progress.fetch(standin.url) is None


# --- status -----------------------------------------------------------------------------


def decide(manifest: dict, pods: list[dict], report: dict | None, seconds: int = 1):
    acts = reconcile.decide(manifest, pods, T0 + timedelta(seconds=seconds), "img", report)
    errors: list = []
    apply(st.STATUS, acts.status, "status", errors)
    assert errors == [], errors  # what is written fits the CRD's status schema
    return acts


def running(**spec) -> tuple[dict, list[dict]]:
    """A job whose world runs, as the operator left it after its last reconcile."""
    manifest = job_manifest(**spec)
    pods = pods_of(manifest)
    manifest["status"] = decide(manifest, pods, None).status
    assert manifest["status"]["phase"] == st.RUNNING
    return manifest, pods


def test_a_report_becomes_progress_and_training_figures():
    manifest, pods = running()
    status = decide(manifest, pods, Progress.parse(REPORT), seconds=2).status
    assert status["progress"] == "3/20"
    assert status["training"] == {
        "phase": "training",
        "step": 3,
        "steps": 20,
        "loss": 2.25,
        "samplesPerSecond": 41.5,
        "bubble": 0.31,
        "updateTime": "2025-01-02T03:04:07Z",
    }
    preflight = st.condition(status, st.PREFLIGHT)
    assert preflight["status"] == "True" and preflight["reason"] == "PreflightPassed"
    assert preflight["message"] == "3 links ok"
    assert status["phase"] == st.RUNNING


def test_peak_memory_lands_in_the_training_figures():
    manifest, pods = running()
    memory = {
        "master": {"rssPeakBytes": 5 << 20},
        "stage0": {"rssPeakBytes": 7 << 20, "cudaPeakBytes": 3 << 20},
    }
    status = decide(manifest, pods, Progress.parse(REPORT | {"memory": memory}), seconds=2).status
    assert status["training"]["memory"] == memory  # and it fits the schema (decide checks)


def test_an_evaluation_lands_in_the_training_figures_and_stays_to_the_end():
    manifest, pods = running(eval={"everySteps": 5})
    report = Progress.parse(
        REPORT | {"step": 10, "evalStep": 10, "evalLoss": 1.75, "evalAccuracy": 0.625}
    )
    manifest["status"] = decide(manifest, pods, report, seconds=2).status
    training = manifest["status"]["training"]
    assert (training["evalStep"], training["evalLoss"], training["evalAccuracy"]) == (
        10,
        1.75,
        0.625,
    )
    assert "evalPerplexity" not in training  # unknown: not shown
    pods[0]["status"] = {
        "phase": "Succeeded",
        "containerStatuses": [{"name": "trainer", "state": {"terminated": {"exitCode": 0}}}],
    }
    status = decide(manifest, pods, None, seconds=3).status
    assert status["phase"] == st.SUCCEEDED
    assert status["training"]["evalAccuracy"] == 0.625  # the last evaluation stays


def test_the_masters_last_report_in_its_termination_message_completes_the_figures():
    """The final evaluation comes after the last step, often after the last poll: a master
    that exits 0 leaves its last report as its termination message, and the status shows it."""
    manifest, pods = running(eval={"everySteps": 5})
    manifest["status"] = decide(manifest, pods, Progress.parse(REPORT), seconds=2).status
    final = REPORT | {
        "step": 20,
        "phase": "finished",
        "evalStep": 20,
        "evalLoss": 0.5,
        "evalAccuracy": 0.875,
    }
    pods[0]["status"] = {
        "phase": "Succeeded",
        "containerStatuses": [
            {
                "name": "trainer",
                "state": {"terminated": {"exitCode": 0, "message": json.dumps(final)}},
            }
        ],
    }
    training = decide(manifest, pods, None, seconds=3).status["training"]
    assert (training["evalStep"], training["evalLoss"], training["evalAccuracy"]) == (
        20,
        0.5,
        0.875,
    )
    assert training["phase"] == "finished" and training["step"] == 20
    pods[0]["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = "not a report"
    assert "evalStep" not in decide(manifest, pods, None, seconds=3).status["training"]


def test_the_same_report_again_changes_nothing_so_nothing_is_written():
    manifest, pods = running()
    manifest["status"] = decide(manifest, pods, Progress.parse(REPORT), seconds=2).status
    again = decide(manifest, pods, Progress.parse(REPORT), seconds=9)
    assert again.status == manifest["status"]  # no status patch, no watch event, no loop
    assert again.create == again.delete == again.events == []


def test_without_a_report_the_last_figures_stay():
    manifest, pods = running()
    manifest["status"] = decide(manifest, pods, Progress.parse(REPORT), seconds=2).status
    later = decide(manifest, pods, None, seconds=5).status
    assert later["progress"] == "3/20" and later["training"] == manifest["status"]["training"]


def test_a_resumed_world_reports_where_it_resumed():
    manifest, pods = running()
    report = Progress.parse(REPORT | {"step": 7, "resumedFromStep": 5, "preflight": None})
    status = decide(manifest, pods, report).status
    assert status["progress"] == "7/20"
    assert status["training"]["resumedFromStep"] == 5
    assert st.condition(status, st.PREFLIGHT) is None  # nothing said, nothing shown


def test_success_shows_every_step_done_even_between_polls():
    manifest, pods = running()
    manifest["status"] = decide(manifest, pods, Progress.parse(REPORT), seconds=2).status
    pods[0]["status"] = {
        "phase": "Succeeded",
        "containerStatuses": [{"name": "trainer", "state": {"terminated": {"exitCode": 0}}}],
    }
    status = decide(manifest, pods, None, seconds=3).status
    assert status["phase"] == st.SUCCEEDED
    assert status["progress"] == "20/20"
    assert status["training"]["phase"] == "finished" and status["training"]["step"] == 20
    assert status["training"]["loss"] == 2.25  # the last reported figures stay


def test_a_failed_preflight_reported_by_the_master_is_a_false_condition():
    manifest, pods = running()
    why = "stage 1 (rank 2, j-stage-1.j) did not join within 60s"
    report = Progress.parse(
        REPORT | {"phase": "failed", "step": 0, "preflight": {"ok": False, "message": why}}
    )
    status = decide(manifest, pods, report).status
    preflight = st.condition(status, st.PREFLIGHT)
    assert (preflight["status"], preflight["reason"]) == ("False", "PreflightFailed")
    assert preflight["message"] == why


def test_a_preflight_termination_message_is_a_false_condition_and_the_restart_cause():
    manifest, pods = running(backoffLimit=2)
    why = "preflight: stage 1 (rank 2, address j-stage-1.j) did not take part within 60s"
    pods[0]["status"] = {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": "trainer",
                "state": {
                    "terminated": {
                        "exitCode": 1,
                        "reason": "Error",
                        "message": why,
                        "finishedAt": "2025-01-02T03:04:06Z",
                    }
                },
            }
        ],
    }
    acts = decide(manifest, pods, None)
    preflight = st.condition(acts.status, st.PREFLIGHT)
    assert (preflight["status"], preflight["reason"], preflight["message"]) == (
        "False",
        "PreflightFailed",
        why,
    )
    assert acts.status["phase"] == st.RESTARTING
    assert why in st.condition(acts.status, st.RESTARTING)["message"]
    # A log tail that merely mentions the preflight is no verdict about it.
    pods[0]["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = (
        "Traceback ...\nRuntimeError: preflight: ..."
    )
    assert st.condition(decide(manifest, pods, None).status, st.PREFLIGHT) is None


def test_a_missing_checkpoint_volume_fails_the_job_before_any_pod():
    manifest = job_manifest(checkpoint={"path": "/ckpt", "volume": "ckpt"})
    acts = decide(manifest, [], None)
    assert acts.create == [] and acts.service is None
    assert acts.status["phase"] == st.FAILED
    failed = st.condition(acts.status, st.FAILED)
    assert failed["reason"] == "InvalidSpec"
    assert "spec.checkpoint.volume" in failed["message"] and "'ckpt'" in failed["message"]
