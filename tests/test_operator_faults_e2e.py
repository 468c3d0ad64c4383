"""Faults on the emulated cluster (issue 19), through the unmodified operator and the real
trainer (the process-kubelet runs the operator's own pods as processes): a member frozen
mid-training is named by the watchdog, the operator restarts the world with reason Stalled
and an Event naming the member, and the new world resumes from its checkpoint and finishes.
The test prints the seconds from the fault to the operator's restart."""

from __future__ import annotations

import signal
import time

import pytest
from test_operator_progress_e2e import KIND, NS, SMALL, log_steps, status

from harness import jobs

pytestmark = pytest.mark.timeout(420)


def test_a_frozen_stage_restarts_the_world_as_stalled_and_it_resumes(
    cluster, kubelet, operator, tmp_path
):
    api = cluster.api
    steps, every, bound = 12, 2, 10
    ckpt = tmp_path / "checkpoints"  # the process-kubelet mounts nothing: a shared directory
    spec = {**SMALL, "steps": steps, "backoffLimit": 2, "watchdog": {"seconds": bound},
            "checkpoint": {"path": str(ckpt), "everySteps": every, "volume": "ckpt"},
            "template": {"volumes": [{"name": "ckpt", "hostPath": {
                "path": str(ckpt), "type": "DirectoryOrCreate"}}]}}  # fmt: skip
    job = jobs.create(api, jobs.example("resnet50-pipeline.yaml", **spec))
    name = job["metadata"]["name"]
    master, frozen = f"{name}-master-0", f"{name}-stage-1"
    jobs.wait_pods(api, name, [master, f"{name}-stage-0", frozen], 20)
    k = every + 1  # past a checkpoint
    api.wait(f"step {k} done", lambda: max(log_steps(kubelet.logs(NS, master)), default=0) >= k,
             180)  # fmt: skip
    kubelet.kill(NS, frozen, signal.SIGSTOP)  # a hung GPU or file read: alive, silent
    struck = time.monotonic()
    first_world = [kubelet.run(NS, f"{name}-{m}") for m in ("master-0", "stage-0")]

    restarting = api.wait("the operator's restart", lambda: (
        c if (c := next((c for c in status(api, name).get("conditions") or []
                         if c["type"] == "Restarting" and c["status"] == "True"), None))
        else None), 120)  # fmt: skip
    reacted = time.monotonic() - struck
    assert restarting["reason"] == "Stalled", restarting
    assert f"stage1 (pod {frozen}) stopped answering: no heartbeat for" in restarting["message"]
    assert f"(found by master 0, pod {master})" in restarting["message"]
    stalled = api.wait(
        "the Stalled event",
        lambda: [  # kopf posts events after the status
            e for e in api.list("v1/events", NS) if e.get("reason") == "Stalled"
        ],
        30,
    )
    assert f"stage1 (pod {frozen}) stopped answering" in stalled[0]["message"], stalled
    for run in first_world:  # the verdict in one line, the peer that lost it quietly
        api.wait(f"{run.name} of the first world gone", lambda run=run: not run.running, 60)
        log = run.log.read_text(errors="replace")
        assert "Traceback" not in log and "tensorpipe_agent" not in log, log

    done = jobs.wait_phase(api, KIND, name, "Succeeded", timeout=240)
    assert done["status"]["restarts"] == 1
    resumed = done["status"]["training"]["resumedFromStep"]
    assert resumed > 0 and resumed % every == 0
    print(f"frozen stage on the emulated cluster: restart (Stalled) {reacted:.1f} s after the"
          f" fault (bound {bound} s); resumed from step {resumed}")  # fmt: skip


@pytest.mark.timeout(120)
def test_the_operator_converges_after_the_api_server_was_away(cluster, operator):
    """For a while every request of the operator gets HTTP 500 and its watches are dropped;
    meanwhile a job is created and a pod of another job fails. Afterwards the operator makes
    the new job's world once, restarts the other's once, and the status says both."""
    from test_operator_integration import WORLD, phase, pipeline, set_pod, world

    api = cluster.api
    jobs.create(api, pipeline())  # "pj": running before the outage
    first = {p["metadata"]["uid"] for p in world(api)}
    for name in WORLD:
        set_pod(api, name, "Running")
    phase(api, "Running")

    cluster.faults.fail_for(15)
    jobs.create(api, pipeline("later"))
    set_pod(api, WORLD[2], "Failed", exit_code=1)  # pj's stage 1 fails while no one looks
    api.wait("the operator refused a while", lambda: cluster.faults.refused >= 3, 15)
    assert jobs.pods(api, "later") == []  # nothing could be made meanwhile

    later = jobs.wait_pods(api, "later", ["later-master-0", "later-stage-0", "later-stage-1"],
                           timeout=60)  # fmt: skip
    restarted = phase(api, "Restarting", "Pending")
    assert restarted["status"]["restarts"] == 1
    assert restarted["status"]["conditions"]
    second = world(api, restart=1)
    assert not first & {p["metadata"]["uid"] for p in second}  # a whole new world, once
    time.sleep(3)  # a few more reconciles: nothing is made twice
    for job, count in (("pj", 3), ("later", 3)):
        names = [p["metadata"]["name"] for p in jobs.pods(api, job)]
        assert len(names) == len(set(names)) == count, names
    assert {p["metadata"]["uid"] for p in jobs.pods(api, "later")} == {
        p["metadata"]["uid"] for p in later}  # fmt: skip
    assert (jobs.get(api, "PipelineJob", "later") or {}).get("status", {}).get("phase")
