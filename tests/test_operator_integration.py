"""The unmodified operator (`pipejob operator`, kopf) against the API server emulator over HTTP,
with the real CRDs from crds/. No kubelet here: the tests play it at the boundary, writing pod
statuses through the API as a kubelet would."""

from __future__ import annotations

import time

import pytest

from harness import jobs
from harness.client import Api
from harness.selectors import matches
from pipejob.operator.kube import RESTART_LABEL as RESTART
from pipejob.operator.kube import SPEC_HASH

pytestmark = pytest.mark.timeout(60)

NS = "default"
PODS = "v1/pods"
POLICIES = "networking.k8s.io/v1/networkpolicies"
JOB = "pj"
WORLD = [f"{JOB}-master-0", f"{JOB}-stage-0", f"{JOB}-stage-1"]
LONG_RUNNING = {"name": "trainer", "state": {"running": {"startedAt": "2020-01-01T00:00:00Z"}}}


def pipeline(name: str = JOB, **spec) -> dict:
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": name},
        "spec": {"model": "resnet18", "stages": 2, "steps": 3, **spec},
    }


def world(api: Api, restart: int = 0, names: list[str] = WORLD) -> list[dict]:
    """The job's pods of that restart, once all of them exist. A PipelineJob's master comes
    first (operator/master_check.py), and no master serves /progress here: the operator makes
    the others once it has run UNREAD_SECONDS unread, so its container started long ago."""

    def made() -> list[dict] | None:
        found = [
            p for p in jobs.pods(api, JOB) if p["metadata"]["labels"].get(RESTART) == str(restart)
        ]
        for pod in found:
            if (
                pod["metadata"]["name"] == names[0]
                and (pod.get("status") or {}).get("phase") != "Running"
            ):
                status = {"phase": "Running", "containerStatuses": [LONG_RUNNING]}
                api.patch(PODS, names[0], {"status": status}, NS, subresource="status")
        return found if jobs.names(found) == sorted(names) else None

    return api.wait(f"pods {', '.join(names)}", made, 20)


def set_pod(
    api: Api, name: str, phase: str, exit_code: int | None = None, reason: str = "Error"
) -> None:
    """Report a pod's phase (and its container's exit) as the kubelet would."""
    status: dict = {"phase": phase}
    if exit_code is not None:
        status["containerStatuses"] = [
            {
                "name": "trainer",
                "state": {
                    "terminated": {
                        "exitCode": exit_code,
                        "reason": "Completed" if exit_code == 0 else reason,
                        "finishedAt": "2030-01-01T00:00:00Z",
                    }
                },
            }
        ]
    api.patch(PODS, name, {"status": status}, NS, subresource="status")


def phase(api: Api, *phases: str, name: str = JOB) -> dict:
    return jobs.wait_phase(api, "PipelineJob", name, phases, timeout=20)


def condition(job: dict, kind: str) -> dict:
    return next(c for c in job["status"]["conditions"] if c["type"] == kind)


def test_a_job_gets_its_headless_service_and_one_pod_per_process(cluster, operator):
    api = cluster.api
    job = jobs.create(api, pipeline())
    pods = {p["metadata"]["name"]: p for p in world(api)}
    owner = {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "name": JOB,
        "uid": job["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }

    service = api.get("v1/services", JOB, NS)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert service["spec"]["selector"] == {"pipejob.dev/job": JOB}
    assert service["metadata"]["ownerReferences"] == [owner]

    for rank, name in enumerate(WORLD):
        pod = pods[name]
        spec, container = pod["spec"], pod["spec"]["containers"][0]
        env = jobs.env(pod)
        role, index = name.split("-")[1:]
        assert (spec["hostname"], spec["subdomain"]) == (name, JOB)  # its DNS name: name.pj
        assert spec["restartPolicy"] == "Never"  # the operator restarts worlds, not pods
        assert container["command"] == ["python", "-m", "pipejob.trainer"]
        assert env["MASTER_ADDR"] == f"{JOB}-master-0.{JOB}" and env["WORLD_SIZE"] == "3"
        assert (env["RANK"], env["PIPEJOB_ROLE"], env["PIPEJOB_ROLE_INDEX"]) == (
            str(rank),
            role,
            index,
        )
        labels = {
            "pipejob.dev/job": JOB,
            "pipejob.dev/role": role,
            "pipejob.dev/index": index,
            "pipejob.dev/restart": "0",
        }
        assert labels.items() <= pod["metadata"]["labels"].items()
        assert pod["metadata"]["ownerReferences"] == [owner]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert env["PIPEJOB_MASTER_FIRST"] == "pods"  # its master was made first
        assert pod["status"]["phase"] == ("Running" if role == "master" else "Pending")

    pending = phase(api, "Pending")
    assert condition(pending, "Created")["status"] == "True"
    assert pending["status"]["restarts"] == 0
    uid = job["metadata"]["uid"]
    created = lambda: [  # noqa: E731
        e
        for e in api.list("v1/events", NS)
        if e["involvedObject"].get("uid") == uid and e["reason"] == "CreatedPods"
    ]
    events = api.wait("two Events about the job", lambda: len(created()) == 2 and created(), 10)
    said = sorted(e["message"] for e in events)  # the master first, then the others
    assert said == [f"created pods {JOB}-master-0", f"created pods {', '.join(WORLD[1:])}"]


def test_a_hybrid_jobs_trainers_meet_for_ddp_on_trainer_0(cluster, operator):
    api = cluster.api
    manifest = {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": "hj"},
        "spec": {"trainers": 2},
    }
    jobs.create(api, manifest)
    names = ["hj-master-0", "hj-ps-0", "hj-trainer-0", "hj-trainer-1"]
    env = {p["metadata"]["name"]: jobs.env(p) for p in jobs.wait_pods(api, "hj", names, 20)}
    for k in (0, 1):
        trainer = env[f"hj-trainer-{k}"]
        assert trainer["PIPEJOB_DDP_ADDR"] == "hj-trainer-0.hj"
        assert trainer["PIPEJOB_DDP_RANK"] == str(k) and trainer["PIPEJOB_DDP_WORLD_SIZE"] == "2"
        assert trainer["PIPEJOB_DDP_PORT"] != trainer["MASTER_PORT"]
        assert trainer["RANK"] == str(k + 2)
    assert "PIPEJOB_DDP_ADDR" not in env["hj-ps-0"] and env["hj-ps-0"]["RANK"] == "1"
    ports = {p["name"]: p["port"] for p in api.get("v1/services", "hj", NS)["spec"]["ports"]}
    master = env["hj-master-0"]
    assert ports == {
        "rpc": int(master["MASTER_PORT"]),
        "ddp": int(env["hj-trainer-0"]["PIPEJOB_DDP_PORT"]),
        "preflight": int(master["PIPEJOB_PREFLIGHT_PORT"]),
        "monitor": int(master["PIPEJOB_MONITOR_PORT"]),
    }


def test_status_follows_the_pods_to_success(cluster, operator):
    api = cluster.api
    jobs.create(api, pipeline())
    for pod in world(api):
        set_pod(api, pod["metadata"]["name"], "Running")
    running = phase(api, "Running")
    assert running["status"]["roles"]["stage"]["running"] == 2
    set_pod(api, f"{JOB}-master-0", "Succeeded", exit_code=0)
    done = phase(api, "Succeeded")
    assert done["status"]["completionTime"] and condition(done, "Succeeded")["status"] == "True"
    # The stages would wait in rpc.shutdown forever: the operator removes them.
    api.wait("the stages gone", lambda: jobs.names(jobs.pods(api, JOB)) == [f"{JOB}-master-0"], 20)


def test_a_failed_pod_restarts_the_world_until_the_backoff_limit(cluster, operator):
    api = cluster.api
    jobs.create(api, pipeline(backoffLimit=1))
    first = {p["metadata"]["name"]: p["metadata"]["uid"] for p in world(api)}
    set_pod(api, f"{JOB}-stage-1", "Failed", exit_code=1)
    restarting = phase(api, "Restarting")
    assert restarting["status"]["restarts"] == 1
    second = {p["metadata"]["name"]: p["metadata"]["uid"] for p in world(api, restart=1)}
    assert not set(first.values()) & set(second.values())  # a whole new world
    warned = [e for e in api.list("v1/events", NS) if e["type"] == "Warning"]
    assert any("stage 1" in e["message"] and "exit code 1" in e["message"] for e in warned)

    set_pod(api, f"{JOB}-stage-0", "Failed", exit_code=1)
    failed = phase(api, "Failed")
    reason = condition(failed, "Failed")
    assert reason["reason"] == "BackoffLimitExceeded" and failed["status"]["restarts"] == 1
    assert f"stage 0 (pod {JOB}-stage-0) failed with exit code 1" in reason["message"]


def test_an_oom_killed_stage_comes_back_with_more_memory_then_fails_at_the_cap(cluster, operator):
    api = cluster.api
    memory = {"limits": {"memory": "600Mi"}}
    jobs.create(
        api, pipeline(backoffLimit=0, template={"resources": memory}, oom={"maxMemory": "900Mi"})
    )
    world(api)
    set_pod(api, f"{JOB}-stage-1", "Failed", 137, "OOMKilled")
    restarting = phase(api, "Restarting")
    assert restarting["status"]["restarts"] == 0 and restarting["status"]["oomKills"] == 1
    assert restarting["status"]["memory"] == {"stage": "900Mi"}
    raised = {p["metadata"]["name"]: p for p in world(api, restart=1)}
    limits = {n: p["spec"]["containers"][0]["resources"]["limits"] for n, p in raised.items()}
    assert limits == {
        f"{JOB}-master-0": {"memory": "600Mi"},
        f"{JOB}-stage-0": {"memory": "900Mi"},
        f"{JOB}-stage-1": {"memory": "900Mi"},
    }
    assert any("recreating the world with 900Mi for role stage" in w for w in jobs.warnings(api))
    set_pod(api, f"{JOB}-stage-0", "Failed", 137, "OOMKilled")
    failed = condition(phase(api, "Failed"), "Failed")
    assert failed["reason"] == "OOMKilled"
    assert "role stage needs more than 900Mi" in failed["message"], failed


def test_a_job_managed_by_another_controller_is_left_to_it(cluster, operator):
    """MultiKueue's job (spec.managedBy) gets no pods and no status from this operator; a job
    naming pipejob's own operator, created after it, runs as any other."""
    api = cluster.api
    jobs.create(api, pipeline("elsewhere", managedBy="kueue.x-k8s.io/multikueue"))
    jobs.create(api, pipeline(managedBy="pipejob.dev/operator"))
    world(api)
    phase(api, "Pending")
    assert jobs.pods(api, "elsewhere") == [] and api.find("v1/services", "elsewhere", NS) is None
    assert "status" not in jobs.get(api, "PipelineJob", "elsewhere")


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        # A field the schema lets through but no pod could run with.
        ({"template": {"env": [{"name": "RANK", "value": "1"}]}}, "spec.template.env[0].name"),
        # The CRD's CEL rule would refuse this at the apiserver; the emulator does not enforce
        # schemas, so this shows the operator's own check behind it.
        ({"batchSize": 10, "microBatches": 4}, "spec.microBatches"),
    ],
)
def test_an_invalid_spec_fails_with_the_field_path_and_no_pods(cluster, operator, spec, field):
    api = cluster.api
    jobs.create(api, pipeline(**spec))
    failed = phase(api, "Failed")
    reason = condition(failed, "Failed")
    assert reason["reason"] == "InvalidSpec" and field in reason["message"]
    assert jobs.pods(api, JOB) == [] and api.find("v1/services", JOB, NS) is None


def test_suspend_removes_the_world_and_resume_brings_it_back(cluster, operator):
    api = cluster.api
    jobs.create(api, pipeline())
    world(api)
    api.patch(jobs.resource("PipelineJob"), JOB, {"spec": {"suspend": True}}, NS)
    phase(api, "Suspended")
    api.wait("no pods", lambda: jobs.pods(api, JOB) == [], 20)
    api.patch(jobs.resource("PipelineJob"), JOB, {"spec": {"suspend": False}}, NS)
    world(api)
    assert phase(api, "Pending")["status"]["restarts"] == 0


def test_a_job_resumed_while_its_old_pods_terminate_spends_no_restart(cluster, operator):
    """Resumed before its suspended world's pods are gone (each holds a finalizer, as a pod in
    its grace period stays): the world made again under the same number waits for their names,
    and their going is no member's failure."""
    api, resource = cluster.api, jobs.resource("PipelineJob")
    jobs.create(api, pipeline())
    old = {p["metadata"]["uid"] for p in world(api)}
    for name in WORLD:
        api.patch(PODS, name, {"metadata": {"finalizers": ["test.pipejob.dev/hold"]}}, NS)
    api.patch(resource, JOB, {"spec": {"suspend": True}}, NS)
    phase(api, "Suspended")

    def terminating() -> bool:
        return all(p["metadata"].get("deletionTimestamp") for p in jobs.pods(api, JOB))

    def status() -> dict:
        return jobs.get(api, "PipelineJob", JOB)["status"]

    def renewed() -> bool:
        pods = jobs.pods(api, JOB)
        return bool(pods) and not {p["metadata"]["uid"] for p in pods} & old

    api.wait("the old pods terminating", terminating, 20)
    resumed = api.patch(resource, JOB, {"spec": {"suspend": False}}, NS)["metadata"]
    api.wait("the resume seen", lambda: status()["observedGeneration"] == resumed["generation"], 20)
    time.sleep(2)  # a few reconciles while the old pods terminate
    for name in WORLD:
        api.patch(PODS, name, {"metadata": {"finalizers": None}}, NS)
    api.wait("a new world's first pod", renewed, 20)
    assert status()["restarts"] == 0, status()["conditions"]
    world(api)  # made again under number 0
    assert phase(api, "Pending")["status"]["restarts"] == 0


def test_deleting_a_job_deletes_what_it_made_and_nothing_else(cluster, operator):
    api = cluster.api
    jobs.create(api, pipeline())
    world(api)
    api.create(
        PODS,
        {
            "metadata": {"name": "bystander", "labels": {"pipejob.dev/job": JOB}},
            "spec": {"containers": [{"name": "c", "image": "x"}]},
        },
        NS,
    )
    api.delete(jobs.resource("PipelineJob"), JOB, NS)
    assert jobs.names(jobs.pods(api, JOB)) == ["bystander"]
    assert api.find("v1/services", JOB, NS) is None


def test_deadline_and_ttl(cluster, operator):
    api = cluster.api
    jobs.create(api, pipeline("late", activeDeadlineSeconds=1, ttlSecondsAfterFinished=2))
    failed = jobs.wait_phase(api, "PipelineJob", "late", "Failed", timeout=20)
    assert condition(failed, "Failed")["reason"] == "DeadlineExceeded"
    api.wait(
        "the job deleted after its TTL", lambda: jobs.get(api, "PipelineJob", "late") is None, 20
    )
    assert jobs.pods(api, "late") == []


def test_a_restarted_operator_converges_on_what_it_observes(cluster, operator):
    api = cluster.api
    jobs.create(api, pipeline())
    uids = {p["metadata"]["uid"] for p in world(api)}
    phase(api, "Pending")
    operator.kill()
    for name in WORLD:  # the world moves on while no operator watches
        set_pod(api, name, "Running")
    operator.start()
    running = phase(api, "Running")
    assert running["status"]["restarts"] == 0
    assert {p["metadata"]["uid"] for p in jobs.pods(api, JOB)} == uids  # nothing re-made


def selected(api: Api, policy: dict) -> list[str]:
    """The pods of the namespace that the policy's podSelector selects."""
    selector = policy["spec"]["podSelector"]
    return jobs.names([p for p in api.list(PODS, NS) if matches(selector, p["metadata"]["labels"])])


def test_each_world_has_a_network_policy_selecting_exactly_its_pods_that_goes_with_the_job(
    cluster, operator
):
    api = cluster.api
    job = jobs.create(api, pipeline())
    jobs.create(
        api,
        {
            "apiVersion": "pipejob.dev/v1alpha1",
            "kind": "HybridJob",
            "metadata": {"name": "hj"},
            "spec": {"trainers": 2},
        },
    )
    pods = world(api)
    hybrid = ["hj-master-0", "hj-ps-0", "hj-trainer-0", "hj-trainer-1"]
    jobs.wait_pods(api, "hj", hybrid, 20)
    mine, theirs = api.get(POLICIES, JOB, NS), api.get(POLICIES, "hj", NS)
    assert selected(api, mine) == WORLD and selected(api, theirs) == hybrid
    # Its pods admit the world's pods only (the selector as the peer), on every port.
    assert mine["spec"]["ingress"] == [{"from": [{"podSelector": mine["spec"]["podSelector"]}]}]
    assert mine["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    # Made before any pod of its world: no pod runs open for a moment.
    revision = int(mine["metadata"]["resourceVersion"])
    assert all(revision < int(p["metadata"]["resourceVersion"]) for p in pods)

    # Tampered with (now admitting everyone), then a new world of another size: the policy is
    # the operator's again, and selects the new world.
    api.patch(POLICIES, JOB, {"spec": {"ingress": [{}]}}, NS)
    edited = api.patch(jobs.resource("PipelineJob"), JOB, {"spec": {"stages": 3}}, NS)
    bigger = sorted([*WORLD, f"{JOB}-stage-2"])
    new_world = lambda: {p["metadata"]["annotations"][SPEC_HASH] for p in jobs.pods(api, JOB)}  # noqa: E731
    world(api, 0, bigger)
    api.wait("the new world only", lambda: len(new_world()) == 1, 20)
    assert edited["metadata"]["generation"] == 2
    assert api.get(POLICIES, JOB, NS)["spec"] == mine["spec"]
    assert selected(api, mine) == bigger

    api.delete(jobs.resource("PipelineJob"), JOB, NS)  # it goes with its job, and only its own
    assert api.find(POLICIES, JOB, NS) is None and api.find(POLICIES, "hj", NS) is not None


def test_a_network_policy_of_the_jobs_name_that_is_not_its_own_is_left_alone_and_no_pod_runs(
    cluster, operator
):
    api = cluster.api
    foreign = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": JOB},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
    }
    api.create(POLICIES, foreign, NS)
    jobs.create(api, pipeline())

    def refused() -> dict | None:
        job = jobs.get(api, "PipelineJob", JOB) or {}
        created = [c for c in job.get("status", {}).get("conditions", []) if c["type"] == "Created"]
        return created[0] if created and created[0]["reason"] == "NetworkPolicyRefused" else None

    said = api.wait("the policy refused", refused, 20)
    assert f"NetworkPolicy '{JOB}'" in said["message"] and "HTTP 422" in said["message"]
    assert jobs.pods(api, JOB) == [] and api.get(POLICIES, JOB, NS)["spec"] == foreign["spec"]
    api.delete(POLICIES, JOB, NS)  # the name is free: the next resync makes the world
    world(api)
    assert api.get(POLICIES, JOB, NS)["metadata"]["ownerReferences"][0]["kind"] == "PipelineJob"
