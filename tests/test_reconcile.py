"""The operator's decision (reconcile.decide) over plain dicts: what it creates, deletes and
reports for each situation a job can be in. `Sim` plays the API server: it applies the
actions to dicts, so a test can walk a job through its life one reconcile at a time."""

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from pipejob.core.contract import Progress
from pipejob.core.schema import apply
from pipejob.core.spec import API_VERSION, parse
from pipejob.operator import kube, reconcile
from pipejob.operator import status as st

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
IMAGE = "trainer:test"
UID = "job-uid-1"
_uids = itertools.count()


class Sim:
    """A job and its pods as an API server would hold them, plus the last actions."""

    def __init__(self, kind="PipelineJob", name="j", checks=True, **spec):
        # checks: the master made alone passes its own check at once (master_check.py)
        self.checks = checks
        self.job = {
            "apiVersion": API_VERSION,
            "kind": kind,
            "metadata": {"name": name, "namespace": "ns", "uid": UID, "generation": 1},
            "spec": spec,
        }
        self.pods: dict[str, dict] = {}
        self.now = T0
        self.acts: reconcile.Actions | None = None
        self.service_created = 0

    @property
    def status(self):
        return self.job.get("status") or {}

    def reconcile(self, **later) -> reconcile.Actions:
        self.now += timedelta(**later) if later else timedelta(seconds=1)
        acts = reconcile.decide(self.job, list(self.pods.values()), self.now, IMAGE)
        if self.checks and master_alone(acts):  # a poll finds the master checked at once
            checked = Progress(
                step=0, steps=int(self.job["spec"].get("steps", 1)), phase="preflight"
            )
            acts = reconcile.decide(self.job, list(self.pods.values()), self.now, IMAGE, checked)
        errors = []
        apply(st.STATUS, acts.status, "status", errors)
        assert errors == [], errors  # every status written fits the CRD's status schema
        if acts.service:
            self.service_created += 1
        for pod in acts.create:
            assert pod["metadata"]["name"] not in self.pods, "would create a duplicate"
            pod = dict(pod, status={"phase": "Pending"})
            pod["metadata"] = dict(pod["metadata"], uid=f"pod-uid-{next(_uids)}")
            self.pods[pod["metadata"]["name"]] = pod
        self.job["status"] = acts.status
        for pod in acts.delete:
            self.pods.pop(pod["metadata"]["name"])
        self.acts = acts
        return acts

    def set_phase(self, name, phase, exit_code=None, finished="2025-01-02T03:05:00Z"):
        pod = self.pods[name]
        pod["status"] = {"phase": phase}
        if exit_code is not None:
            pod["status"]["containerStatuses"] = [
                {
                    "name": "trainer",
                    "state": {
                        "terminated": {
                            "exitCode": exit_code,
                            "reason": "Error" if exit_code else "Completed",
                            "finishedAt": finished,
                        }
                    },
                }
            ]

    def run_all(self):
        for name in self.pods:
            self.set_phase(name, "Running")
        return self.reconcile()

    def names(self):
        return sorted(self.pods)

    def events(self):
        return [(e.type, e.reason) for e in self.acts.events]


def master_alone(acts: reconcile.Actions) -> bool:
    """Whether `acts` make a world's master and none of the others (master_check.waiting)."""
    return [kube.role_of(p) for p in acts.create] == ["master"]


def started(**spec) -> Sim:
    sim = Sim(**spec)
    sim.reconcile()
    sim.run_all()
    assert sim.status["phase"] == "Running"
    return sim


def test_a_new_job_gets_its_service_and_every_pod_once():
    sim = Sim(stages=2)
    acts = sim.reconcile()
    assert sim.names() == ["j-master-0", "j-stage-0", "j-stage-1"]
    assert acts.service["metadata"]["name"] == "j" and sim.service_created == 1
    assert sim.status["phase"] == "Pending"
    assert st.is_true(sim.status, "Created")
    assert sim.status["startTime"] == "2025-01-02T03:04:06Z"
    assert sim.status["restarts"] == 0 and sim.status["observedGeneration"] == 1
    assert ("Normal", "CreatedPods") in sim.events()
    assert all(p["spec"]["containers"][0]["image"] == IMAGE for p in sim.pods.values())
    again = sim.reconcile()  # level-based: the same observation asks for nothing new
    assert again.create == [] and again.delete == [] and again.service is None
    assert again.events == [] and again.status == sim.status


def test_running_when_every_pod_runs_with_counts_per_role():
    sim = Sim("HybridJob", trainers=2)
    sim.reconcile()
    sim.set_phase("j-master-0", "Running")
    sim.reconcile()
    assert sim.status["phase"] == "Pending"
    assert sim.status["roles"]["master"] == {
        "pending": 0,
        "running": 1,
        "succeeded": 0,
        "failed": 0,
    }
    assert sim.status["roles"]["trainer"]["pending"] == 2
    sim.run_all()
    assert sim.status["phase"] == "Running"
    assert sim.events() == [("Normal", "AllPodsRunning")]
    assert st.is_true(sim.status, "Running")


def test_a_partly_created_world_is_completed_not_restarted():
    sim = Sim(stages=2)
    sim.reconcile()
    del sim.pods["j-stage-1"]  # as if the operator died before creating it
    sim.job["status"]["conditions"] = []
    acts = sim.reconcile()
    assert [p["metadata"]["name"] for p in acts.create] == ["j-stage-1"]
    assert sim.status["restarts"] == 0


def test_master_success_succeeds_the_job_and_stops_the_rest():
    sim = started(stages=2)
    sim.set_phase("j-master-0", "Succeeded", 0)
    sim.set_phase("j-stage-0", "Succeeded", 0)
    acts = sim.reconcile()
    assert sim.status["phase"] == "Succeeded"
    assert [p["metadata"]["name"] for p in acts.delete] == ["j-stage-1"]  # still running
    assert sim.names() == ["j-master-0", "j-stage-0"]  # finished pods stay for their logs
    assert sim.status["completionTime"] == st.timestamp(sim.now)
    assert ("Normal", "MasterSucceeded") in sim.events()
    assert "j-master-0" in st.condition(sim.status, "Succeeded")["message"]
    later = sim.reconcile()
    assert later.create == [] and later.delete == [] and later.events == []


def test_a_finished_replicated_world_keeps_its_replica_count_as_its_pods_go():
    sim = started(stages=2, replicas=2)
    assert sim.status["replicas"] == 2
    for name in [n for n in sim.names() if "-r1-" not in n]:
        sim.set_phase(name, "Succeeded", 0)  # replica 0 has finished, replica 1 is stopped
    sim.reconcile()
    assert sim.status["phase"] == "Succeeded" and sim.names() == [
        "j-master-0",
        "j-r0-stage-0",
        "j-r0-stage-1",
    ]
    sim.reconcile()
    assert sim.status["replicas"] == 2


def test_a_failed_pod_restarts_the_whole_world():
    sim = started(stages=2)
    sim.set_phase("j-stage-1", "Failed", 137)
    acts = sim.reconcile()
    assert sim.status["phase"] == "Restarting" and sim.status["restarts"] == 1
    assert sorted(p["metadata"]["name"] for p in acts.delete) == [
        "j-master-0",
        "j-stage-0",
        "j-stage-1",
    ]
    (event,) = acts.events
    assert event.type == "Warning" and event.reason == "PodFailed"
    assert "stage 1 (pod j-stage-1) failed with exit code 137" in event.message
    assert "restarting the world (1/3)" in event.message
    assert not st.is_true(sim.status, "Created")
    acts = sim.reconcile()  # the old world is gone: the new one is made, restart label 1
    assert sim.names() == ["j-master-0", "j-stage-0", "j-stage-1"]
    assert {kube.restart_of(p) for p in sim.pods.values()} == {1}
    assert sim.status["phase"] == "Restarting"
    sim.run_all()
    assert sim.status["phase"] == "Running" and sim.status["restarts"] == 1


def test_the_new_world_waits_for_the_old_pods_to_go():
    sim = started(stages=2)
    sim.set_phase("j-stage-0", "Failed", 1)
    acts = sim.reconcile()
    # The API server keeps them while they terminate, marked for deletion.
    for pod in acts.delete:
        pod["metadata"]["deletionTimestamp"] = "2025-01-02T03:05:00Z"
        sim.pods[pod["metadata"]["name"]] = pod
    acts = sim.reconcile()
    assert acts.create == [] and acts.delete == []  # no duplicate names, no second delete
    assert sim.status["restarts"] == 1
    sim.pods.pop("j-master-0")
    acts = sim.reconcile()
    assert [p["metadata"]["name"] for p in acts.create] == ["j-master-0"]
    assert acts.create[0]["metadata"]["labels"][kube.RESTART_LABEL] == "1"


@pytest.mark.parametrize("edit", ["resumed", "shrunk"])
def test_a_world_made_again_under_its_number_waits_for_the_old_pods_without_a_restart(edit):
    # Resumed, or of an edited spec: the new world has the old one's number and pod names.
    sim = started(stages=3)
    sim.job["spec"]["suspend" if edit == "resumed" else "stages"] = True if edit == "resumed" else 2
    acts = sim.reconcile()
    for pod in acts.delete:  # the API server keeps them while they terminate
        pod["metadata"]["deletionTimestamp"] = "2025-01-02T03:05:00Z"
        sim.pods[pod["metadata"]["name"]] = pod
    sim.job["spec"]["suspend"] = False
    for _ in range(3):
        assert sim.reconcile().create == []
        assert not st.is_true(sim.status, "Created")  # the terminating pods are not this world's
    sim.pods.clear()
    sim.reconcile()
    assert {kube.restart_of(p) for p in sim.pods.values()} == {0}
    sim.run_all()
    assert sim.status["restarts"] == 0 and sim.status["phase"] != "Restarting"


def test_the_first_pod_to_fail_is_blamed():
    sim = started(stages=2)
    sim.set_phase("j-master-0", "Failed", 1, finished="2025-01-02T03:06:00Z")
    sim.set_phase("j-stage-1", "Failed", 3, finished="2025-01-02T03:05:30Z")
    sim.reconcile()
    assert "stage 1 (pod j-stage-1) failed with exit code 3" in sim.acts.events[0].message


def test_failed_after_backoff_limit_naming_role_pod_and_exit_code():
    sim = started(stages=2, backoffLimit=1)
    sim.set_phase("j-stage-0", "Failed", 1)
    sim.reconcile()
    sim.reconcile()
    sim.run_all()
    assert sim.status["restarts"] == 1
    sim.set_phase("j-stage-0", "Failed", 3)  # retryable (2 and 5 are permanent: test_failures)
    acts = sim.reconcile()
    assert sim.status["phase"] == "Failed"
    failed = st.condition(sim.status, "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    assert "stage 0 (pod j-stage-0) failed with exit code 3" in failed["message"]
    assert "backoffLimit 1" in failed["message"]
    assert ("Warning", "BackoffLimitExceeded") in sim.events()
    assert sorted(p["metadata"]["name"] for p in acts.delete) == ["j-master-0", "j-stage-1"]
    assert sim.names() == ["j-stage-0"]  # the failed pod stays for its logs
    assert sim.reconcile().create == []  # a failed job makes nothing


def test_backoff_limit_zero_fails_at_once():
    sim = started(stages=2, backoffLimit=0)
    sim.set_phase("j-master-0", "Failed", 1)
    sim.reconcile()
    assert sim.status["phase"] == "Failed" and sim.status["restarts"] == 0


def test_evicted_pod_restarts_the_world():
    sim = started(stages=2)
    sim.pods["j-stage-0"]["status"] = {
        "phase": "Failed",
        "reason": "Evicted",
        "message": "The node was low on memory.",
    }
    acts = sim.reconcile()
    assert acts.events[0].reason == "PodEvicted" and sim.status["restarts"] == 1


def test_a_pod_deleted_while_running_restarts_the_world():
    sim = started(stages=2)
    del sim.pods["j-stage-0"]
    acts = sim.reconcile()
    assert acts.events[0].reason == "PodDeleted"
    assert "stage 0 (pod j-stage-0) was deleted" in acts.events[0].message
    assert sim.status["restarts"] == 1 and acts.create == []


def test_deadline_fails_the_job():
    sim = started(stages=2, activeDeadlineSeconds=60)
    sim.reconcile(seconds=30)
    assert sim.status["phase"] == "Running"
    acts = sim.reconcile(seconds=30)
    assert sim.status["phase"] == "Failed"
    assert st.condition(sim.status, "Failed")["reason"] == "DeadlineExceeded"
    assert len(acts.delete) == 3
    assert ("Warning", "DeadlineExceeded") in sim.events()


def test_ttl_deletes_the_finished_job():
    sim = started(stages=2, ttlSecondsAfterFinished=100)
    sim.set_phase("j-master-0", "Succeeded", 0)
    sim.reconcile()
    assert not sim.reconcile(seconds=50).delete_job
    assert sim.reconcile(seconds=50).delete_job


def test_suspend_removes_the_world_and_resume_recreates_it():
    sim = started(stages=2)
    sim.job["spec"]["suspend"] = True
    sim.job["metadata"]["generation"] = 2
    acts = sim.reconcile()
    assert len(acts.delete) == 3 and sim.names() == []
    assert sim.status["phase"] == "Suspended" and "startTime" not in sim.status
    assert sim.status["observedGeneration"] == 2
    assert sim.reconcile().create == []
    sim.job["spec"]["suspend"] = False
    acts = sim.reconcile()
    assert sim.names() == ["j-master-0", "j-stage-0", "j-stage-1"]
    assert sim.status["restarts"] == 0  # a suspension is no failure
    assert sim.status["phase"] == "Pending" and not st.is_true(sim.status, "Suspended")
    assert sim.status["startTime"] == st.timestamp(sim.now)


def test_invalid_spec_fails_with_the_field_path_and_makes_no_pods():
    sim = Sim(stages=2, batchSize=30, microBatches=4)
    acts = sim.reconcile()
    assert acts.create == [] and acts.service is None
    failed = st.condition(sim.status, "Failed")
    assert sim.status["phase"] == "Failed" and failed["reason"] == "InvalidSpec"
    assert "spec.microBatches" in failed["message"]
    assert ("Warning", "InvalidSpec") in sim.events()
    # An edit that is still wrong says what is wrong now.
    sim.job["spec"]["batchSize"] = 32
    sim.job["spec"]["template"] = {"env": [{"name": "RANK", "value": "1"}]}
    sim.job["metadata"]["generation"] = 2
    sim.reconcile()
    assert sim.events() == [("Warning", "InvalidSpec")]
    assert "spec.template.env[0].name" in st.condition(sim.status, "Failed")["message"]
    # An edit that fixes the spec gets the job going.
    del sim.job["spec"]["template"]
    assert sim.reconcile().create == []  # the same generation is not looked at again
    sim.job["metadata"]["generation"] = 3
    acts = sim.reconcile()
    assert len(acts.create) == 3 and sim.status["phase"] == "Pending"


def test_semantic_checks_are_invalid_spec_too():
    sim = Sim(template={"env": [{"name": "WORLD_SIZE", "value": "9"}]})
    sim.reconcile()
    assert "spec.template.env[0].name" in st.condition(sim.status, "Failed")["message"]
    assert sim.names() == []


def test_name_too_long_for_pod_names_is_invalid():
    sim = Sim(name="x" * 41)
    sim.reconcile()
    assert "metadata.name" in st.condition(sim.status, "Failed")["message"]


def test_pods_of_other_owners_are_left_alone_but_block_their_names():
    sim = Sim(stages=2)
    stranger = {
        "metadata": {
            "name": "j-stage-1",
            "uid": "u",
            "labels": {kube.JOB_LABEL: "j", kube.RESTART_LABEL: "0"},
            "ownerReferences": [{"controller": True, "uid": "older-job"}],
        },
        "status": {"phase": "Running"},
    }
    sim.pods["j-stage-1"] = stranger
    acts = sim.reconcile()
    assert sorted(p["metadata"]["name"] for p in acts.create) == ["j-master-0", "j-stage-0"]
    assert acts.delete == [] and not st.is_true(sim.status, "Created")
    assert "stage" not in sim.status["roles"]


def test_pods_of_an_older_world_are_deleted():
    sim = started(stages=2)
    old = dict(sim.pods["j-stage-0"])
    old["metadata"] = dict(
        old["metadata"],
        name="j-stage-9",
        labels=dict(old["metadata"]["labels"], **{kube.RESTART_LABEL: "7"}),
    )
    sim.pods["j-stage-9"] = old
    acts = sim.reconcile()
    assert [p["metadata"]["name"] for p in acts.delete] == ["j-stage-9"]
    assert sim.status["phase"] == "Running"


def test_an_edited_spec_recreates_the_world_without_counting_a_restart():
    sim = started(stages=2)
    sim.job["spec"]["stages"] = 3
    sim.job["metadata"]["generation"] = 2
    acts = sim.reconcile()
    assert len(acts.delete) == 3 and sim.names() == []
    assert sim.events() == [("Normal", "SpecChanged")]
    assert sim.status["phase"] == "Pending" and sim.status["restarts"] == 0
    sim.reconcile()
    assert sim.names() == ["j-master-0", "j-stage-0", "j-stage-1", "j-stage-2"]
    assert {kube.spec_hash_of(p) for p in sim.pods.values()} == {kube.spec_hash(parse(sim.job))}
    sim.run_all()
    assert sim.status["phase"] == "Running"


def test_editing_run_controls_keeps_the_world():
    sim = started(stages=2)
    sim.job["spec"].update(backoffLimit=5, activeDeadlineSeconds=3600, ttlSecondsAfterFinished=9)
    acts = sim.reconcile()
    assert acts.delete == [] and acts.create == [] and sim.status["phase"] == "Running"


def test_restarting_says_what_broke_until_the_new_world_runs():
    sim = started(stages=2)
    sim.set_phase("j-stage-1", "Failed", 1)
    sim.reconcile()
    sim.reconcile()  # the new world is created
    restarting = st.condition(sim.status, "Restarting")
    assert sim.status["phase"] == "Restarting" and restarting["reason"] == "PodFailed"
    assert "pod j-stage-1" in restarting["message"]
    sim.run_all()
    sim.job["spec"]["seed"] = 7  # a later re-creation is no restart
    sim.reconcile()
    sim.reconcile()
    assert sim.status["phase"] == "Pending" and sim.status["restarts"] == 1


def test_workers_finishing_before_the_master_keep_the_job_running():
    sim = Sim(stages=2)
    sim.reconcile()
    sim.run_all()
    assert sim.status["phase"] == st.RUNNING
    sim.set_phase("j-stage-0", "Succeeded", exit_code=0)
    sim.set_phase("j-stage-1", "Succeeded", exit_code=0)
    sim.reconcile()
    assert sim.status["phase"] == st.RUNNING and sim.events() == []
    sim.set_phase("j-master-0", "Succeeded", exit_code=0)
    sim.reconcile()
    assert sim.status["phase"] == st.SUCCEEDED
