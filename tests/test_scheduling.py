"""spec.scheduling without a cluster: its refusals (with field paths), the pods and PodGroups
each gang scheduler gets, and the operator's decisions: Queued until admitted, preemption
that spends no backoffLimit, and a Kueue pod group ended or left to succeed."""

from __future__ import annotations

import pytest
from test_reconcile import Sim

from pipejob.core.spec import API_VERSION, InvalidSpec, parse
from pipejob.operator import api_refusals, gang, kube, queueing, reconcile

pytestmark = pytest.mark.timeout(30)

KUEUE = {"provider": "kueue", "queue": "team-a"}
GATE = [{"name": "kueue.x-k8s.io/admission"}]


def manifest(**spec) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "PipelineJob",
        "metadata": {"name": "j"},
        "spec": {"stages": 2, **spec},
    }


def errors(**spec) -> list[str]:
    with pytest.raises(InvalidSpec) as caught:
        parse(manifest(**spec))
    return [str(e) for e in caught.value.errors]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            {"scheduling": {"provider": "kueue"}},
            "spec.scheduling.queue: kueue needs the LocalQueue",
        ),
        ({"scheduling": {"provider": "slurm"}}, "spec.scheduling.provider: must be one of"),
        ({"scheduling": {"queue": "q"}}, "spec.scheduling.provider: is required"),
        (
            {"scheduling": {"provider": "coscheduling", "queue": "q"}},
            "spec.scheduling.queue: coscheduling has no queues",
        ),
        (
            {"scheduling": {"provider": "volcano", "scheduleTimeoutSeconds": 5}},
            "spec.scheduling.scheduleTimeoutSeconds: scheduleTimeoutSeconds is read by"
            " coscheduling",
        ),
        (
            {"scheduling": {**KUEUE, "schedulerName": "volcano"}},
            "spec.scheduling.schedulerName: kueue works with the pods' own scheduler",
        ),
        (
            {"scheduling": {"provider": "volcano"}, "template": {"schedulerName": "other"}},
            "spec.template.schedulerName: volcano and coscheduling set the pods' scheduler",
        ),
        (
            {"scheduling": KUEUE, "template": {"priorityClassName": "high"}},
            "spec.template.priorityClassName: with spec.scheduling, the priority class goes",
        ),
        ({"scheduling": {**KUEUE, "queue": "Team A"}}, "spec.scheduling.queue: must match"),
        (
            {"scheduling": {"provider": "coscheduling", "scheduleTimeoutSeconds": 0}},
            "spec.scheduling.scheduleTimeoutSeconds: must be >= 1",
        ),
        (
            {"topology": {"required": "cloud.provider.com/topology-rack"}},
            "spec.topology: topology-aware scheduling is Kueue's",
        ),
        (
            {"scheduling": KUEUE, "topology": {"required": "a", "preferred": "b"}},
            "spec.topology: give one of required or preferred",
        ),
        (
            {"scheduling": KUEUE, "topology": {"preferred": "rack name"}},
            "spec.topology.preferred: must be a node label key",
        ),
        ({"managedBy": "multikueue"}, "spec.managedBy: must be a domain-prefixed name"),
    ],
)
def test_refusals_name_the_field(spec: dict, expected: str) -> None:
    found = errors(**spec)
    assert any(e.startswith(expected) for e in found), found


def test_kueue_pods_form_one_group_with_names_unique_per_world() -> None:
    job = parse(manifest(scheduling={**KUEUE, "priorityClassName": "high"}))
    for world in (0, 3):
        pods = kube.world(job, world, "ns")
        for pod in pods:
            meta, spec = pod["metadata"], pod["spec"]
            assert meta["name"] == f"{spec['hostname']}-r{world}"  # DNS names stay fixed
            assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
            assert meta["labels"]["kueue.x-k8s.io/pod-group-name"] == "j"
            assert meta["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"
            assert spec["priorityClassName"] == "high" and "schedulerName" not in spec
        assert [p["spec"]["hostname"] for p in pods] == ["j-master-0", "j-stage-0", "j-stage-1"]
    assert all(o["kind"] != "PodGroup" for o in kube.render(job, "ns"))


@pytest.mark.parametrize("which", ["required", "preferred"])
def test_topology_becomes_kueues_topology_annotation_on_every_pod_of_every_world(which) -> None:
    job = parse(manifest(scheduling=KUEUE, topology={which: "cloud.provider.com/topology-block"}))
    for world in (0, 2):
        for pod in kube.world(job, world, "ns"):
            annotations = pod["metadata"]["annotations"]
            assert annotations[f"kueue.x-k8s.io/podset-{which}-topology"] == (
                "cloud.provider.com/topology-block"
            )
            assert not {k for k in annotations if k.endswith("-topology")} - {
                f"kueue.x-k8s.io/podset-{which}-topology"
            }
    plain = kube.world(parse(manifest(scheduling=KUEUE)), 0, "ns")
    assert not any("topology" in k for p in plain for k in p["metadata"]["annotations"])


def test_volcano_pods_and_their_podgroup() -> None:
    resources = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    job = parse(
        manifest(
            scheduling={"provider": "volcano", "queue": "research", "priorityClassName": "high"},
            template={"resources": resources},
        )
    )
    service, _, group, *pods = kube.render(job, "ns")
    assert group == {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "PodGroup",
        "metadata": {
            "name": "j",
            "namespace": "ns",
            "labels": {"pipejob.dev/job": "j", "app.kubernetes.io/managed-by": "pipejob"},
        },
        "spec": {
            "minMember": 3,
            "minResources": {"cpu": "1500m", "memory": "3221225472"},
            "queue": "research",
            "priorityClassName": "high",
        },
    }
    for pod in pods:
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "j"
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["metadata"]["name"] == pod["spec"]["hostname"]


def test_coscheduling_pods_and_their_podgroup() -> None:
    job = parse(manifest(scheduling={"provider": "coscheduling", "scheduleTimeoutSeconds": 120}))
    owner = {
        "apiVersion": API_VERSION,
        "kind": "PipelineJob",
        "name": "j",
        "uid": "u",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    pods = kube.world(job, 0, "ns", owner)
    group = gang.podgroup(job, pods, "ns", owner)
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"] == {"minMember": 3, "scheduleTimeoutSeconds": 120}
    assert group["metadata"]["ownerReferences"] == [owner]  # deleting the job deletes it
    for pod in pods:
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "j"
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"


@pytest.mark.parametrize(
    ("amounts", "total"),
    [
        (["100m", "250m"], "350m"),
        (["1", "500m"], "1500m"),
        (["1Gi", "1Gi"], "2147483648"),
        ([1, 2], "3"),
        (["1k", "0.5k"], "1500"),
    ],
)
def test_requests_sum_as_quantities(amounts: list, total: str) -> None:
    pods = [{"spec": {"containers": [{"resources": {"requests": {"x": a}}}]}} for a in amounts]
    assert gang.requests(pods) == {"x": total}


def kueue_sim(**spec) -> Sim:
    sim = Sim(stages=2, scheduling=KUEUE, **spec)
    sim.reconcile()
    for pod in sim.pods.values():  # as Kueue's webhook leaves them
        pod["spec"]["schedulingGates"] = list(GATE)
    return sim


def admit(sim: Sim) -> None:
    """Kueue admits the group: its pods' scheduling gates go."""
    for pod in sim.pods.values():
        pod["spec"].pop("schedulingGates")


def test_a_gated_world_is_queued_and_its_admission_is_an_event() -> None:
    sim = kueue_sim()
    sim.reconcile()
    assert sim.status["phase"] == "Queued"
    queued = next(c for c in sim.status["conditions"] if c["type"] == "Queued")
    assert queued["reason"] == "WaitingForAdmission" and "LocalQueue team-a" in queued["message"]
    assert ("Normal", "WaitingForAdmission") in sim.events()
    admit(sim)
    sim.reconcile()
    assert ("Normal", "Admitted") in sim.events() and sim.status["phase"] == "Pending"
    sim.run_all()
    assert sim.status["phase"] == "Running"


def test_preemption_restarts_the_world_without_spending_backoff_limit() -> None:
    sim = Sim(stages=2, backoffLimit=0)
    sim.reconcile()
    sim.run_all()
    sim.set_phase("j-master-0", "Failed", 3)  # its peer fails for losing it: not the cause
    sim.pods["j-stage-1"]["status"]["conditions"] = [
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "PreemptionByScheduler",
            "message": "preempted by a higher priority pod",
        }
    ]
    acts = sim.reconcile()
    assert sim.status["phase"] == "Restarting" and sim.status["restarts"] == 0
    assert sim.status["preemptions"] == 1 and sim.pods == {}
    (event,) = acts.events
    assert (event.type, event.reason) == ("Warning", "Preempted")
    assert "stage 1 (pod j-stage-1) was preempted (PreemptionByScheduler" in event.message
    sim.reconcile()
    assert {p["metadata"]["labels"]["pipejob.dev/restart"] for p in sim.pods.values()} == {"1"}


def test_kueue_waits_for_the_old_world_to_stop_before_the_new_one() -> None:
    sim = kueue_sim(backoffLimit=2)
    admit(sim)
    sim.run_all()
    sim.set_phase("j-stage-0-r0", "Failed", 1)
    acts = sim.reconcile()
    assert sim.status["restarts"] == 1 and acts.create == []
    # Kueue's finalizer keeps a deleted pod until it has stopped: the new world waits for it.
    lingering = {**acts.delete[0], "status": {"phase": "Running"}}
    lingering["metadata"] = {**lingering["metadata"], "deletionTimestamp": "2025-01-02T03:05:00Z"}
    sim.pods[lingering["metadata"]["name"]] = lingering
    assert sim.reconcile().create == []
    lingering["status"] = {"phase": "Failed"}
    assert sorted(p["metadata"]["name"] for p in sim.reconcile().create) == [
        "j-master-0-r1",
        "j-stage-0-r1",
        "j-stage-1-r1",
    ]


def test_a_failed_kueue_job_ends_its_group() -> None:
    sim = kueue_sim(backoffLimit=0)
    admit(sim)
    sim.run_all()
    sim.set_phase("j-stage-0-r0", "Failed", 1)
    acts = sim.reconcile()
    assert sim.status["phase"] == "Failed"
    assert sorted(p["metadata"]["name"] for p in acts.end_group) == [
        "j-master-0-r0",
        "j-stage-0-r0",
        "j-stage-1-r0",
    ]


def test_a_succeeded_kueue_job_lets_its_pods_exit_then_ends_a_group_they_did_not() -> None:
    sim = kueue_sim()
    admit(sim)
    sim.run_all()
    sim.set_phase("j-master-0-r0", "Succeeded", 0)
    acts = sim.reconcile()
    assert sim.status["phase"] == "Succeeded"
    assert acts.delete == [] and acts.end_group == []  # the stages leave rpc.shutdown themselves
    sim.set_phase("j-stage-0-r0", "Succeeded", 0)
    acts = sim.reconcile(seconds=queueing.KUEUE_SUCCESS_GRACE + 1)
    # stage 1 never exited: it is stopped, and the group, which cannot succeed, is ended.
    assert [p["metadata"]["name"] for p in acts.delete] == ["j-stage-1-r0"]
    assert len(acts.end_group) == 3


def test_a_succeeded_kueue_group_whose_pods_all_exited_0_is_left_to_succeed() -> None:
    sim = kueue_sim()
    admit(sim)
    sim.run_all()
    for name in sim.names():
        sim.set_phase(name, "Succeeded", 0)
    sim.reconcile()
    acts = sim.reconcile(seconds=queueing.KUEUE_SUCCESS_GRACE + 1)
    assert sim.status["phase"] == "Succeeded" and acts.end_group == [] and acts.delete == []


@pytest.mark.parametrize("provider", ["volcano", "coscheduling"])
def test_a_world_its_gang_scheduler_has_not_placed_is_queued(provider: str) -> None:
    sim = Sim(stages=2, scheduling={"provider": provider})
    acts = sim.reconcile()
    assert acts.podgroup["spec"]["minMember"] == 3 and acts.podgroup["kind"] == "PodGroup"
    for pod in sim.pods.values():
        pod["status"]["conditions"] = [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "pod group is not ready",
            }
        ]
    assert sim.reconcile().podgroup is None  # made with the pods, once
    assert sim.status["phase"] == "Queued"
    message = next(c for c in sim.status["conditions"] if c["type"] == "Queued")["message"]
    assert "PodGroup j (minMember 3)" in message and "pod group is not ready" in message


def test_a_refused_podgroup_makes_no_pods_and_says_why_once() -> None:
    sim = Sim(stages=2, scheduling={"provider": "volcano"})
    old = sim.job.get("status") or {}
    error = "POST .../podgroups: HTTP 404: the server could not find the requested resource"
    acts = api_refusals.without_podgroup(
        reconcile.decide(sim.job, [], sim.now, "img"), old, error, sim.now
    )
    assert acts.create == [] and acts.podgroup is None
    assert acts.status["phase"] == "Pending"
    created = next(c for c in acts.status["conditions"] if c["type"] == "Created")
    assert (created["status"], created["reason"]) == ("False", "PodGroupRefused")
    assert "HTTP 404" in created["message"]
    assert "scheduling.<provider>.enabled" in created["message"]
    reasons = [e.reason for e in acts.events]
    assert "PodGroupRefused" in reasons and "CreatedPods" not in reasons
    sim.job["status"] = acts.status  # the next reconcile, refused again: no second Warning
    again = api_refusals.without_podgroup(
        reconcile.decide(sim.job, [], sim.now, "img"), acts.status, error, sim.now
    )
    assert "PodGroupRefused" not in [e.reason for e in again.events]
