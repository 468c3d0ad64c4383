"""Faults on the emulated cluster (issue 19), through the unmodified operator and the real
trainer (the process-kubelet runs the operator's own pods as processes): a member frozen
mid-training is named by the watchdog, the operator restarts the world with reason Stalled
and an Event naming the member, and the new world resumes from its checkpoint; there a
stage's work gets stuck while it still beats (the user's model, tests/userpkg/stuck.py), the
world is restarted as Stalled again, naming the stage it waits on, and the third world
resumes and finishes. A HybridJob's trainer frozen, then its parameter server killed, restart
its world the same way (Stalled, then PodFailed naming the ps), each world resuming from the
last. The tests print the seconds from each fault to the operator's restart."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from test_operator_progress_e2e import KIND, NS, SMALL, log_steps, status

from harness import jobs
from harness.client import Api

pytestmark = pytest.mark.timeout(600)
TESTS = Path(__file__).parent  # holds userpkg/: on the pods' PYTHONPATH through the template


# slow: the hybrid test below restarts a Stalled world; test_watchdog.py freezes a stage
@pytest.mark.slow
def test_a_frozen_stage_restarts_the_world_as_stalled_and_it_resumes(
    cluster, kubelet, operator, tmp_path
):
    api = cluster.api
    steps, every, bound = 120, 2, 10  # steps of a few ms: enough that no world ends early
    ckpt = tmp_path / "checkpoints"  # the process-kubelet mounts nothing: a shared directory
    trigger = tmp_path / "stuck"  # while it exists, stage1 (rank 2) computes no forward
    model = {"import": "userpkg.stuck:cnn", "args": {"trigger": str(trigger), "rank": 2}}
    spec = {
        **SMALL,
        "engine": "rpc",  # the verdict names the rpc engine's calls (forward_round, passed_on)
        "steps": steps,
        "backoffLimit": 3,
        "watchdog": {"seconds": bound},
        "model": model,
        "checkpoint": {"path": str(ckpt), "everySteps": every, "volume": "ckpt"},
        "template": {
            "env": [{"name": "PYTHONPATH", "value": str(TESTS)}],
            "volumes": [
                {"name": "ckpt", "hostPath": {"path": str(ckpt), "type": "DirectoryOrCreate"}}
            ],
        },
    }
    job = jobs.create(api, jobs.example("resnet50-pipeline.yaml", **spec))
    name = job["metadata"]["name"]
    master, frozen = f"{name}-master-0", f"{name}-stage-1"
    # The stages' pods come once the master has checked the model (master_check.py).
    jobs.wait_pods(api, name, [master, f"{name}-stage-0", frozen], 120)
    k = every + 1  # past a checkpoint
    api.wait(
        f"step {k} done", lambda: max(log_steps(kubelet.logs(NS, master)), default=0) >= k, 180
    )
    kubelet.kill(NS, frozen, signal.SIGSTOP)  # a hung GPU or file read: alive, silent
    struck = time.monotonic()
    first_world = [kubelet.run(NS, f"{name}-{m}") for m in ("master-0", "stage-0")]

    restarting = api.wait(
        "the operator's restart",
        lambda: (
            c
            if (
                c := next(
                    (
                        c
                        for c in status(api, name).get("conditions") or []
                        if c["type"] == "Restarting" and c["status"] == "True"
                    ),
                    None,
                )
            )
            else None
        ),
        120,
    )
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

    # The second world's stage1 gets stuck in its first forward: its work, not its process.
    trigger.touch()
    jobs.wait_pods(api, name, [master, f"{name}-stage-0", frozen], 120, restart=1)
    second = api.wait(
        "the second world's resumption",
        lambda: (
            int(m[1])
            if (m := re.search(r"resumed from step (\d+)", kubelet.logs(NS, master)))
            else None
        ),
        180,
    )
    struck = time.monotonic()  # its first step begins
    restarting = api.wait(
        "the second restart",
        lambda: (
            c
            if (
                c := next(
                    (
                        c
                        for c in status(api, name).get("conditions") or []
                        if c["type"] == "Restarting" and c["status"] == "True"
                    ),
                    None,
                )
            )
            and status(api, name).get("restarts") == 2
            else None
        ),
        120,
    )
    stuck = time.monotonic() - struck
    trigger.unlink()  # the third world's stage1 computes again
    assert restarting["reason"] == "Stalled", restarting
    assert re.search(
        rf"no progress for \d+ s in training at step {second}: waiting on stage0"
        rf" \(pod [^)]+\) for on_stage forward_round \(called \d+ s ago\), which waits on"
        rf" stage1 \(pod {frozen}\) for passed_on",
        restarting["message"],
    ), restarting

    done = jobs.wait_phase(api, KIND, name, "Succeeded", timeout=240)
    assert done["status"]["restarts"] == 2, (done["status"], jobs.warnings(api))
    resumed = done["status"]["training"]["resumedFromStep"]
    assert resumed == second  # the stuck world took no step, so wrote no checkpoint
    print(
        f"frozen stage on the emulated cluster: restart (Stalled) {reacted:.1f} s after the"
        f" fault (bound {bound} s); stuck work: restart (Stalled) {stuck:.1f} s after its"
        f" world resumed; resumed from steps {second}, then {resumed}"
    )


@pytest.mark.slow  # a restarted operator converges in test_operator_integration.py
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

    later = jobs.wait_pods(
        api, "later", ["later-master-0", "later-stage-0", "later-stage-1"], timeout=60
    )
    restarted = phase(api, "Restarting", "Pending")
    assert restarted["status"]["restarts"] == 1, (restarted["status"], jobs.warnings(api))
    assert restarted["status"]["conditions"]
    second = world(api, restart=1)
    assert not first & {p["metadata"]["uid"] for p in second}  # a whole new world, once
    time.sleep(3)  # a few more reconciles: nothing is made twice
    for job, count in (("pj", 3), ("later", 3)):
        names = [p["metadata"]["name"] for p in jobs.pods(api, job)]
        assert len(names) == len(set(names)) == count, names
    assert {p["metadata"]["uid"] for p in jobs.pods(api, "later")} == {
        p["metadata"]["uid"] for p in later
    }
    assert (jobs.get(api, "PipelineJob", "later") or {}).get("status", {}).get("phase")


# A HybridJob cut down for 2 CPU cores: a tiny table, a few bags a step.
HYBRID = {
    "trainers": 2,
    "embedding": {"numEmbeddings": 64, "dim": 8, "mode": "sum"},
    "batchSize": 8,
    "datasetSize": 256,
    "logEvery": 1,
    "preflight": {"megabytes": 0.25},
}


def restarted(api: Api, name: str, count: int) -> dict | None:
    """The HybridJob's Restarting condition once it has restarted `count` times, else None."""
    s = (jobs.get(api, "HybridJob", name) or {}).get("status") or {}
    found = next(
        (
            c
            for c in s.get("conditions") or []
            if c["type"] == "Restarting" and c["status"] == "True"
        ),
        None,
    )
    return found if found and s.get("restarts") == count else None


@pytest.mark.timeout(360)  # about 5x a quiet run's minute
def test_a_frozen_trainer_then_a_killed_ps_restart_the_hybrid_world_which_resumes(
    cluster, kubelet, operator, tmp_path
):
    """A trainer frozen mid-training: the master's watchdog names it, the world restarts as
    Stalled and resumes from its checkpoint; there the parameter server is killed: the world
    restarts naming it, resumes again and succeeds. Prints the seconds from each fault to the
    operator's restart and to the new world's pods."""
    api = cluster.api
    # Steps of a few ms: enough that no world ends early. The bound is loose: a restarted
    # world's first step (its DDP group, the table's first lookups) took 12 s in a loaded CI run.
    steps, every, bound = 400, 5, 25
    ckpt = tmp_path / "checkpoints"  # the process-kubelet mounts nothing: a shared directory
    spec = {
        **HYBRID,
        "steps": steps,
        "backoffLimit": 3,
        "watchdog": {"seconds": bound},
        "checkpoint": {"path": str(ckpt), "everySteps": every, "volume": "ckpt"},
        "template": {
            "volumes": [
                {"name": "ckpt", "hostPath": {"path": str(ckpt), "type": "DirectoryOrCreate"}}
            ]
        },
    }
    job = jobs.create(api, jobs.example("hybrid.yaml", **spec))
    name = job["metadata"]["name"]
    master, ps, frozen = f"{name}-master-0", f"{name}-ps-0", f"{name}-trainer-1"
    world = [master, ps, f"{name}-trainer-0", frozen]
    jobs.wait_pods(api, name, world, 20)

    def checkpointed(step: int) -> bool:  # by the latest master, in training
        return f"checkpoint of step {step}:" in kubelet.logs(NS, master)

    api.wait(f"the checkpoint of step {every}", lambda: checkpointed(every), 180)
    kubelet.kill(NS, frozen, signal.SIGSTOP)  # a hung GPU or file read: alive, silent
    struck = time.monotonic()
    first_world = [kubelet.run(NS, p) for p in world if p != frozen]
    restarting = api.wait("the restart after the freeze", lambda: restarted(api, name, 1), 120)
    frozen_restart = time.monotonic() - struck
    assert restarting["reason"] == "Stalled", (restarting, jobs.warnings(api))
    assert (
        f"trainer1 (pod {frozen}) stopped answering: no heartbeat for" in restarting["message"]
    ), restarting
    assert f"(found by master 0, pod {master})" in restarting["message"], restarting
    stalled = api.wait(
        "the Stalled event",
        lambda: [  # kopf posts events after the status
            e for e in api.list("v1/events", NS) if e.get("reason") == "Stalled"
        ],
        30,
    )
    assert f"trainer1 (pod {frozen}) stopped answering" in stalled[0]["message"], stalled
    jobs.wait_pods(api, name, world, 60, restart=1)
    frozen_pods = time.monotonic() - struck
    for run in first_world:  # the verdict in one line, the peers that lost it quietly
        api.wait(f"{run.name} of the first world gone", lambda run=run: not run.running, 60)
        log = run.log.read_text(errors="replace")
        assert "Traceback" not in log and "tensorpipe_agent" not in log, (run.name, log)

    resumed = api.wait(
        "the second world's resumption",
        lambda: (
            int(m[1])
            if (m := re.search(r"resumed from step (\d+)", kubelet.logs(NS, master)))
            else None
        ),
        180,
    )
    assert resumed >= every, resumed
    api.wait(
        f"the checkpoint of step {resumed + every}", lambda: checkpointed(resumed + every), 120
    )
    kubelet.kill(NS, ps)  # SIGKILL, as an OOM kill would
    struck = time.monotonic()
    restarting = api.wait("the restart after the kill", lambda: restarted(api, name, 2), 120)
    killed_restart = time.monotonic() - struck
    assert restarting["reason"] == "PodFailed", (restarting, jobs.warnings(api))
    assert f"ps 0 (pod {ps}) failed with exit code 137" in restarting["message"], restarting
    jobs.wait_pods(api, name, world, 60, restart=2)
    killed_pods = time.monotonic() - struck

    done = jobs.wait_phase(api, "HybridJob", name, "Succeeded", timeout=240)
    assert done["status"]["restarts"] == 2, (done["status"], jobs.warnings(api))
    assert any(f"ps 0 (pod {ps}) failed" in w for w in jobs.warnings(api)), jobs.warnings(api)
    again = done["status"]["training"]["resumedFromStep"]
    assert again >= resumed + every, (resumed, again)  # the second world's own checkpoint
    assert f"step {steps}/{steps}" in kubelet.logs(NS, master)
    print(
        f"hybrid on the emulated cluster: frozen trainer1 -> restart (Stalled) after"
        f" {frozen_restart:.1f} s, new pods after {frozen_pods:.1f} s (bound {bound} s);"
        f" killed ps -> restart (PodFailed) after {killed_restart:.1f} s, new pods after"
        f" {killed_pods:.1f} s; resumed from steps {resumed}, then {again}"
    )
