"""An OOM kill answered with memory (situations.oom_killed, oom_kills.py, spec.oom), decided
over plain dicts with test_reconcile's `Sim`: the role's memory grows 1.5x, no backoffLimit is
spent, the cap fails the job naming role and memory, Kueue gets a new group. The same against
the real operator: test_operator_integration.py; with a real cgroup limit:
test_containers_e2e.py."""

from __future__ import annotations

import pytest
from test_reconcile import Sim, started
from test_scheduling import GATE, KUEUE, errors

from pipejob.core import oom
from pipejob.core.k8s import quantity
from pipejob.operator import status as st

pytestmark = pytest.mark.timeout(30)

MEMORY = {"limits": {"memory": "600Mi"}, "requests": {"memory": "400Mi"}}


def oom_kill(sim: Sim, role_index: str = "stage-1") -> str:
    """The kernel kills the current world's pod `role_index` for memory; its name."""
    name = next(n for n in sim.pods if n.startswith(f"j-{role_index}"))
    sim.set_phase(name, "Failed", exit_code=137)
    sim.pods[name]["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] = "OOMKilled"
    return name


def memory(sim: Sim, role_index: str) -> dict:
    name = next(n for n in sim.pods if n.startswith(f"j-{role_index}"))
    return sim.pods[name]["spec"]["containers"][0]["resources"]


def test_an_oom_killed_stage_restarts_its_world_with_1_5x_its_roles_memory() -> None:
    sim = started(stages=2, backoffLimit=0, template={"resources": MEMORY})
    oom_kill(sim)
    acts = sim.reconcile()
    assert sim.status["phase"] == st.RESTARTING and sim.status["restarts"] == 0
    assert sim.status["oomKills"] == 1 and sim.status["memory"] == {"stage": "900Mi"}
    restarting = st.condition(sim.status, st.RESTARTING)
    assert restarting["reason"] == "OOMKilled" and "900Mi for role stage" in restarting["message"]
    (event,) = acts.events
    assert (event.type, event.reason) == ("Warning", "OOMKilled")
    assert event.message.startswith(
        "stage 1 (pod j-stage-1) was killed for memory (OOMKilled) at 600Mi; recreating the"
        " world with 900Mi for role stage (no backoffLimit spent)"
    )
    sim.reconcile()
    assert {p["metadata"]["labels"]["pipejob.dev/restart"] for p in sim.pods.values()} == {"1"}
    # Every pod of the role grows, the request in proportion; the other roles keep theirs.
    raised = {"limits": {"memory": "900Mi"}, "requests": {"memory": "600Mi"}}
    assert memory(sim, "stage-0") == raised
    assert memory(sim, "stage-1") == memory(sim, "stage-0")
    assert memory(sim, "master-0") == MEMORY
    sim.run_all()
    assert sim.status["phase"] == st.RUNNING


def test_memory_grows_at_each_kill_up_to_the_cap_then_the_job_fails_naming_role_and_memory():
    sim = started(stages=2, template={"resources": MEMORY}, oom={"maxMemory": "1Gi"})
    for expected in ("900Mi", "1Gi"):
        oom_kill(sim)
        sim.reconcile()
        assert sim.status["memory"] == {"stage": expected}
        sim.reconcile()
        sim.run_all()
    oom_kill(sim)
    sim.reconcile()
    failed = st.condition(sim.status, st.FAILED)
    assert sim.status["phase"] == st.FAILED and failed["reason"] == "OOMKilled"
    assert failed["message"] == (
        "stage 1 (pod j-stage-1) was killed for memory (OOMKilled) at 1Gi: role stage needs"
        " more than 1Gi, the most spec.oom.maxMemory allows"
    )
    assert sim.status["restarts"] == 0 and sim.status["oomKills"] == 2


def test_without_max_memory_the_cap_is_four_times_the_templates() -> None:
    policy = oom.policy({"increase": 3}, {"resources": {"limits": {"memory": "1Gi"}}})
    assert policy.raised(quantity("1Gi")) == 3 * 2**30
    assert policy.raised(quantity("3Gi")) == 4 * 2**30


def test_an_increase_of_1_makes_an_oom_kill_an_ordinary_failure() -> None:
    sim = started(stages=2, backoffLimit=1, template={"resources": MEMORY}, oom={"increase": 1})
    oom_kill(sim)
    sim.reconcile()
    assert sim.status["restarts"] == 1 and "oomKills" not in sim.status
    assert "OOMKilled" in st.condition(sim.status, st.RESTARTING)["message"]


def test_a_pod_without_memory_of_its_own_killed_for_memory_is_an_ordinary_failure() -> None:
    sim = started(stages=2, backoffLimit=1)  # the node ran out: nothing to raise
    oom_kill(sim)
    sim.reconcile()
    assert sim.status["restarts"] == 1 and "memory" not in sim.status


def test_an_edited_template_with_more_memory_than_raised_wins() -> None:
    sim = started(stages=2, template={"resources": MEMORY})
    oom_kill(sim)
    sim.reconcile()
    sim.job["spec"]["template"] = {"resources": {"limits": {"memory": "2Gi"}}}
    sim.reconcile()  # the spec changed: a new world
    sim.reconcile()
    assert memory(sim, "stage-0") == {"limits": {"memory": "2Gi"}}


def test_under_kueue_the_raised_world_is_a_new_group_admitted_through_its_queue() -> None:
    sim = Sim(stages=2, scheduling=KUEUE, template={"resources": MEMORY})
    sim.reconcile()
    sim.run_all()
    oom_kill(sim)
    acts = sim.reconcile()
    # The group of the old shape ends: Kueue frees its quota and admits the new one afresh.
    assert sorted(p["metadata"]["name"] for p in acts.end_group) == [
        "j-master-0-r0",
        "j-stage-0-r0",
        "j-stage-1-r0",
    ]
    created = sim.reconcile().create
    labels = {p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] for p in created}
    assert labels == {"j-1"} and all(
        p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" for p in created
    )
    for pod in sim.pods.values():  # Kueue's webhook gates the new group until it is admitted
        pod["spec"]["schedulingGates"] = list(GATE)
    sim.reconcile()
    assert sim.status["phase"] == st.QUEUED


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"oom": {"maxMemory": "lots"}}, "spec.oom.maxMemory: must be a memory quantity"),
        ({"oom": {"increase": 0.5}}, "spec.oom.increase: must be >= 1"),
        ({"oom": {"factor": 2}}, "spec.oom.factor"),
    ],
)
def test_a_bad_oom_section_is_refused_naming_the_field(spec: dict, expected: str) -> None:
    assert any(expected in e for e in errors(**spec)), errors(**spec)
