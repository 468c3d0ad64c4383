"""End to end on the emulated cluster: live progress, metrics and resuming from checkpoints
through the unmodified operator and the real trainer (the process-kubelet runs the operator's
own pod specs as real processes).

The operator runs in the pod network (the harness's `operator` fixture, with a kubelet), as
its pod would on a cluster: it polls the master pod's /progress at its podIP. The tests reach
into that network the same way (PodNetwork.get)."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import jobs
from harness.client import Api
from pipejob.operator import kube

pytestmark = pytest.mark.timeout(240)

NS = "default"
KIND = "PipelineJob"
# The example, cut down for 2 CPU cores: a small model on tiny images.
SMALL = {
    "model": "resnet18",
    "stages": 2,
    "imageSize": 32,
    "batchSize": 4,
    "microBatches": 2,
    "numClasses": 10,
    "logEvery": 1,
    "preflight": {"megabytes": 0.25},
}

OPERATOR_FAMILIES = {
    "pipejob_operator_jobs_created",
    "pipejob_operator_jobs_succeeded",
    "pipejob_operator_jobs_failed",
    "pipejob_operator_jobs_restarted",
    "pipejob_operator_jobs",
    "pipejob_operator_reconcile_duration_seconds",
    "pipejob_operator_progress_poll_duration_seconds",
}
TRAINER_FAMILIES = {
    "pipejob_step",
    "pipejob_steps",
    "pipejob_loss",
    "pipejob_samples_per_second",
    "pipejob_step_seconds",
    "pipejob_bubble_ratio",
    "pipejob_stage_forward_seconds",
    "pipejob_stage_backward_seconds",
    "pipejob_rss_peak_bytes",
}


def families(text: str) -> dict[str, dict[tuple, float]]:
    """{family: {sorted labels: value}} of a Prometheus text page (it must parse)."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(family.name, {})[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def status(api: Api, name: str) -> dict:
    return (jobs.get(api, KIND, name) or {}).get("status") or {}


def steps_done(progress: str | None) -> int:
    return int(progress.split("/")[0]) if progress else 0


def master_ip(api: Api, name: str) -> str:
    return api.get("v1/pods", f"{name}-master-0", NS)["status"]["podIP"]


def log_steps(log: str) -> list[int]:
    """The steps a master logged as done ("step 3/20 ...")."""
    return [int(m) for m in re.findall(r"step (\d+)/\d+", log)]


# slow: the master's progress and metrics in test_monitor.py, the operator's poll into status in
# test_metrics.py
@pytest.mark.slow
def test_status_shows_progress_while_training_and_metrics_scrape(cluster, kubelet, operator):
    api = cluster.api
    steps = 40  # several polls (1 s apart) while it trains
    job = jobs.create(api, jobs.example("resnet50-pipeline.yaml", **SMALL, steps=steps))
    name = job["metadata"]["name"]
    seen: list[int] = []  # status.progress as polled, until the job succeeds

    def midway() -> dict | None:
        s = status(api, name)
        assert s.get("phase") != "Succeeded", f"it finished before progress was seen: {s}"
        done = steps_done(s.get("progress"))
        seen.append(done)
        # Peak memory comes with each logged step, a moment after the step itself.
        measured = "memory" in (s.get("training") or {})
        return s if s.get("phase") == "Running" and 0 < done < steps and measured else None

    running = api.wait("progress between the first and the last step", midway, 150)
    # The trainer master's metrics, scraped at its pod's address as Prometheus would.
    url = f"http://{master_ip(api, name)}:{kube.PORTS.monitor}/metrics"
    trainer = families(kubelet.network.get(url).decode())
    assert TRAINER_FAMILIES <= set(trainer)
    assert trainer["pipejob_steps"][("pipejob_steps",)] == steps
    assert 0 < trainer["pipejob_step"][("pipejob_step",)] <= steps
    stages = {dict(labels[1:])["stage"] for labels in trainer["pipejob_stage_forward_seconds"]}
    assert len(stages) == SMALL["stages"]

    assert running["progress"].endswith(f"/{steps}")
    training = running["training"]
    assert training["phase"] == "training" and training["steps"] == steps
    assert training["loss"] > 0 and training["samplesPerSecond"] > 0
    assert 0 <= training["bubble"] <= 1
    # Each member's peak memory (the stages' answers come a moment after the master's own):
    # the master's at least, and every figure plausible for a torch process.
    assert "master" in training["memory"], training
    assert all(50e6 < m["rssPeakBytes"] < 20e9 for m in training["memory"].values()), training
    preflight = next(c for c in running["conditions"] if c["type"] == "Preflight")
    assert preflight["status"] == "True" and preflight["reason"] == "PreflightPassed"

    def succeeded() -> dict | None:
        s = status(api, name)
        assert s.get("phase") not in ("Failed", "Restarting"), s
        seen.append(steps_done(s.get("progress")))
        return s if s["phase"] == "Succeeded" else None

    done = api.wait("Succeeded", succeeded, 150)
    assert seen == sorted(seen) and len(set(seen)) >= 3  # it moved forward, step by step
    assert done["progress"] == f"{steps}/{steps}" and done["training"]["phase"] == "finished"
    assert done["restarts"] == 0
    # The master's last report (its termination message) has every member's final peak.
    assert set(done["training"]["memory"]) == {
        "master",
        *(f"stage{i}" for i in range(SMALL["stages"])),
    }

    page = families(operator.get(operator.metrics_url).decode())
    assert OPERATOR_FAMILIES <= set(page)
    jobs_by_phase = page["pipejob_operator_jobs"]
    assert jobs_by_phase[("pipejob_operator_jobs", ("kind", KIND), ("phase", "Succeeded"))] == 1
    created = page["pipejob_operator_jobs_created"]
    assert created[("pipejob_operator_jobs_created_total", ("kind", KIND))] == 1
    polls = page["pipejob_operator_progress_poll_duration_seconds"]
    ok = polls[("pipejob_operator_progress_poll_duration_seconds_count", ("result", "ok"))]
    assert ok >= 2
    mean = polls[("pipejob_operator_progress_poll_duration_seconds_sum", ("result", "ok"))] / ok
    print(f"progress seen: {sorted(set(seen))}; {ok:.0f} polls, mean {mean * 1000:.1f} ms")


@pytest.mark.slow  # test_operator_e2e.py's pipelining replicas resume from their checkpoint
def test_a_stage_killed_after_step_k_resumes_from_a_checkpoint_at_most_k(
    cluster, kubelet, operator, tmp_path
):
    api = cluster.api
    steps, every = 16, 2
    ckpt = tmp_path / "checkpoints"  # the process-kubelet mounts nothing: a shared directory
    spec = {
        **SMALL,
        "steps": steps,
        "backoffLimit": 2,
        "checkpoint": {"path": str(ckpt), "everySteps": every, "volume": "ckpt"},
        "template": {
            "volumes": [
                {"name": "ckpt", "hostPath": {"path": str(ckpt), "type": "DirectoryOrCreate"}}
            ]
        },
    }
    job = jobs.create(api, jobs.example("resnet50-pipeline.yaml", **spec))
    name = job["metadata"]["name"]
    master = f"{name}-master-0"
    # The stages' pods come once the master has checked the model (master_check.py).
    world = jobs.wait_pods(api, name, [master, f"{name}-stage-0", f"{name}-stage-1"], 120)
    for pod in world:  # the operator mounts the checkpoint volume in every pod
        assert {"name": "ckpt", "mountPath": str(ckpt)} in pod["spec"]["containers"][0][
            "volumeMounts"
        ]

    k = every * 2 + 1  # past two checkpoints
    api.wait(
        f"step {k} done", lambda: max(log_steps(kubelet.logs(NS, master)), default=0) >= k, 150
    )
    kubelet.kill(NS, f"{name}-stage-1")  # as an OOM kill would
    first_run = kubelet.run(NS, master)
    api.wait("the first master gone", lambda: not first_run.running, 60)
    last_done = max(log_steps(first_run.log.read_text(errors="replace")))

    # The restarted world reports where it resumed while it runs ...
    resumed = api.wait(
        "the new world's resume point in status",
        lambda: (
            s["training"]["resumedFromStep"]
            if (s := status(api, name)).get("restarts") == 1
            and (s.get("training") or {}).get("resumedFromStep")
            else None
        ),
        150,
    )
    assert 0 < resumed <= last_done and resumed % every == 0
    done = jobs.wait_phase(api, KIND, name, "Succeeded", timeout=150)
    assert done["status"]["restarts"] == 1
    assert done["status"]["training"]["resumedFromStep"] == resumed
    assert done["status"]["progress"] == f"{steps}/{steps}"
    # ... and its master logged it, then trained the remaining steps, exactly up to `steps`.
    second_log = kubelet.logs(NS, master)
    assert re.search(rf"resum\w* from (checkpoint at )?step {resumed}\b", second_log), second_log
    second_steps = log_steps(second_log)
    assert second_steps[0] == resumed + 1 and second_steps[-1] == steps
