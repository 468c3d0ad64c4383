"""benchmarks/chaos.py: its invariants each catch what breaks them (over plain dicts), and a
short seeded run of the unmodified operator on the emulated cluster, faults and all, holds
every one of them (issue 60; seeds 1-5 at 50 jobs and 10 minutes are the acceptance run, by
hand: docs/user-guide.md)."""

from __future__ import annotations

import sys
from argparse import Namespace
from collections import Counter, defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _chaos_checks as checks
import chaos
from _chaos_node import checkpoint_place
from _chaos_schedule import FAULT_KINDS, Schedule

from harness.apiserver import Faults
from pipejob.core.spec import parse
from pipejob.operator import kube

pytestmark = pytest.mark.timeout(60)


def pod(name: str, job: str, role: str, index: int, phase: str = "Running", **meta) -> dict:
    labels = {checks.JOB_LABEL: job, checks.ROLE_LABEL: role, checks.INDEX_LABEL: str(index)}
    return {"metadata": {"name": name, "labels": labels, **meta}, "status": {"phase": phase}}


def test_two_live_pods_of_one_rank_are_caught_finished_or_deleted_ones_are_not() -> None:
    check = checks.Check("ranks")
    fine = [
        pod("j-stage-0", "j", "stage", 0),
        pod("j-stage-0-r1", "j", "stage", 0, phase="Failed"),
        pod("j-stage-0-r2", "j", "stage", 0, deletionTimestamp="2030-01-01T00:00:00Z"),
        pod("k-stage-0", "k", "stage", 0),
    ]
    checks.one_pod_per_rank(fine, check)
    assert check.violations == []
    checks.one_pod_per_rank([*fine, pod("j-stage-0-r3", "j", "stage", 0)], check)
    assert check.violations == ["2 live pods of job j role stage index 0"]


def test_a_status_going_backwards_is_caught() -> None:
    history = checks.StatusHistory()
    for status in ({"phase": "Running", "restarts": 1}, {"phase": "Succeeded", "restarts": 1}):
        history.see("j", status)
    assert history.check.violations == []
    history.see("j", {"phase": "Running", "restarts": 0})
    assert history.check.violations == ["j: restarts 1 -> 0", "j: Succeeded -> Running"]


def test_restarts_beyond_the_member_failures_and_leftovers_of_a_deleted_job_are_caught():
    faults: dict[str, Counter] = defaultdict(Counter, {"j": Counter(member=1, oom=1)})
    check = checks.Check("counts")
    checks.counted_right({"j": {"restarts": 1, "oomKills": 1}}, faults, check)
    assert check.violations == []
    checks.counted_right({"j": {"restarts": 2, "preemptions": 1}}, faults, check)
    assert check.violations == [
        "j: restarts 2 > 1 member faults",
        "j: preemptions 1 > 0 node faults",
    ]
    gone = checks.Check("gone")
    checks.left_behind({"d"}, {"v1/pods": [pod("d-master-0", "d", "master", 0)]}, gone)
    assert gone.violations == ["v1/pods d-master-0 of deleted job d"]


def test_a_world_resumed_further_back_than_its_checkpoint_interval_is_caught() -> None:
    work = checks.WorkKept()
    work.resumed("j", 0, every=3)  # the first world: nothing before it
    work.step("j", 8)
    work.resumed("j", 6, every=3)  # its newest checkpoint: 2 steps lost
    work.step("j", 7)  # a later world's step never lowers what the job reached
    assert work.check.violations == [] and work.check.checked == 2
    work.resumed("j", 3, every=3)  # a checkpoint older than the newest
    assert work.check.violations == [
        "j resumed from step 3 after step 8: 5 steps lost, checkpoints every 3"
    ]


def test_the_stand_in_trainer_resumes_from_the_disk_every_world_of_the_job_mounts() -> None:
    """The operator's pods of two worlds keep their checkpoints in one place (the claim of
    the checkpoint volume); a pod without that mount keeps them in its own filesystem."""
    manifest = chaos.manifest("j", "PipelineJob", chaos.random.Random(1))
    manifest["metadata"]["namespace"] = "default"
    job = parse(manifest)
    first, second = (kube.world(job, restart, "default")[0] for restart in (0, 1))
    every, steps = manifest["spec"]["checkpoint"]["everySteps"], manifest["spec"]["steps"]
    for pod_obj, uid in ((first, "a"), (second, "b")):
        pod_obj["metadata"]["uid"] = uid
        assert checkpoint_place(pod_obj) == ("claim j-checkpoints:/checkpoints", every, steps)
    del second["spec"]["containers"][0]["volumeMounts"]
    assert checkpoint_place(second)[0] == "pod b:/checkpoints"


def test_a_seed_fixes_the_whole_schedule_of_jobs_and_faults() -> None:
    """Drawn up front: the same seed, the same jobs and faults (times, kinds, each fault's own
    draws), whatever a run makes of them; another seed, another schedule."""
    run = Namespace(seed=4, jobs=50, minutes=10, gap=3)
    one, two = Schedule(run), Schedule(run)
    assert one.born == two.born and len(one.born) == 50 and one.born[0] == 0
    assert [d.random() for d in one.job_draws] == [d.random() for d in two.job_draws]
    assert one.faults == two.faults and 150 < len(one.faults) < 250  # one every 3 s or so
    assert {f.kind for f in one.faults} == set(FAULT_KINDS)
    assert [f.draws().random() for f in one.faults] == [f.draws().random() for f in two.faults]
    assert Schedule(Namespace(seed=5, jobs=50, minutes=10, gap=3)).faults != one.faults


def test_the_api_server_answers_the_operator_each_fault_as_asked() -> None:
    faults = Faults()
    faults.fail_for(60, code=409)
    assert faults.answer("GET", watch=False) == 0 and faults.answer("PATCH", watch=False) == 409
    assert faults.answer("POST", watch=False) == 0  # a 409 to a create says it exists
    faults.fail_for(60, code=410)
    assert faults.answer("GET", watch=False) == 0 and faults.answer("GET", watch=True) == 410
    faults.fail_for(60, code=0, delay=0.5)
    assert faults.hits("kopf/1.37") and faults.answer("PATCH", watch=False) == 0


@pytest.mark.timeout(300)
def test_a_short_seeded_run_holds_every_invariant(capsys) -> None:
    args = ["--seed", "3", "--jobs", "4", "--minutes", "0.4", "--train", "6", "--gap", "2"]
    code = chaos.main([*args, "--settle", "120"])
    said = capsys.readouterr().out
    assert code == 0, said
    assert "faults injected" in said and "chaos: every invariant held" in said, said
    assert said.count(": held (") == 7, said
