"""`pipejob run` on a machine with fewer GPUs than a job asks for: each process gets its own
GPU where there are enough, shares where sharing trains (pipeline stages), and a job whose
NCCL group members would share one is refused before anything starts.

This machine has no GPU: the tests give the runner a GPU list at its one boundary (the
detector), and a stand-in trainer shows what each process was given."""

from __future__ import annotations

import io
import json
import re

import pytest
import yaml

from jobrun import pipeline_job
from pipejob.core import plan, spec
from pipejob.runner import gpus
from pipejob.runner.local import placed, run_job

HYBRID = {
    "apiVersion": "pipejob.dev/v1alpha1",
    "kind": "HybridJob",
    "metadata": {"name": "h"},
    "spec": {"trainers": 2, "gpusPerTrainer": 1},
}


def processes(manifest):
    return plan.plan_world(spec.parse(manifest), lambda m: "127.0.0.1", plan.Ports())


# ------------------------------------------------------------------ counting GPUs


def test_the_callers_visible_devices_are_the_machines_gpus(tmp_path):
    nodes = tmp_path / "dev"  # what the machine has is ignored once the caller chose
    (nodes / "nvidia0").mkdir(parents=True)
    assert gpus.detect({"CUDA_VISIBLE_DEVICES": "2,3"}, nodes) == ["2", "3"]
    assert gpus.detect({"CUDA_VISIBLE_DEVICES": ""}, nodes) == []
    assert gpus.detect({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, nodes) == ["1"]  # CUDA stops at -1


def test_otherwise_nvidia_smi_then_the_device_nodes_then_the_driver_count_them(
    tmp_path, monkeypatch
):
    nodes, driver = tmp_path / "dev", tmp_path / "gpus"
    nodes.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):  # two GPUs, two others
        (nodes / name).touch()
    for address in ("0000:18:00.0", "0000:3b:00.0", "0000:86:00.0"):  # the host's three
        (driver / address).mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert gpus.detect({}, nodes, driver) == ["0"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi
    assert gpus.detect({}, nodes, driver) == ["0", "1"]
    assert gpus.detect({}, tmp_path / "none", driver) == ["0", "1", "2"]
    assert gpus.detect({}, tmp_path / "none", tmp_path / "none") == []


# ------------------------------------------------------------------ placing processes


def test_enough_gpus_give_each_stage_its_own():
    world = processes(pipeline_job("p", stages=4, microBatches=4, gpusPerStage=1))
    placed = gpus.place(world, ["0", "1", "2", "3", "4"])
    assert placed.note is None
    # The master asks for none and keeps the caller's view.
    assert placed.visible == {1: "0", 2: "1", 3: "2", 4: "3"}


def test_stages_share_fewer_gpus_round_robin_and_say_so():
    # the rpc engine's stages, which may share a GPU (engine auto takes rpc there: below)
    world = processes(pipeline_job("p", engine="rpc", stages=4, microBatches=4, gpusPerStage=1))
    placed = gpus.place(world, ["0", "1"])
    assert placed.visible == {1: "0", 2: "1", 3: "0", 4: "1"}
    assert placed.note == (
        "the job asks for 4 GPUs and this machine has 2 GPUs: its processes share them"
        " (stage0, stage2 on CUDA_VISIBLE_DEVICES=0; stage1, stage3 on"
        " CUDA_VISIBLE_DEVICES=1), which trains, but slower"
    )


def test_a_cpu_job_is_left_alone_and_a_gpu_job_needs_gpus():
    assert gpus.place(processes(pipeline_job("p", stages=2)), []).visible == {}
    with pytest.raises(gpus.NotEnoughGPUs, match="asks for 2 GPUs and this machine has 0 GPUs"):
        gpus.place(processes(pipeline_job("p", stages=2, gpusPerStage=1)), [])


def test_nccl_group_members_never_share_a_gpu():
    # The rpc engine's replicas: stage i of every replica is one NCCL group (dp<i>).
    replicated = pipeline_job(
        "p", engine="rpc", stages=2, microBatches=2, gpusPerStage=1, replicas=2
    )
    assert gpus.place(processes(replicated), ["0", "1", "2", "3"]).note is None
    # Two GPUs: each replica's stages share, and each group's members are apart.
    two = gpus.place(processes(replicated), ["0", "1"])
    assert two.visible == {1: "0", 2: "1", 3: "1", 4: "0"}  # r0-stage0, r0-stage1, r1-...
    with pytest.raises(gpus.NotEnoughGPUs) as refused:
        gpus.place(processes(replicated), ["0"])
    assert str(refused.value).startswith(
        "r0-stage0 and r1-stage0 would share a GPU: the job asks for 4 GPUs and this machine"
        " has 1 GPU, and NCCL cannot run two members of one group (dp0) on one GPU"
    ), refused.value
    # A HybridJob's trainers over NCCL on one GPU: refused, and told of gloo.
    with pytest.raises(gpus.NotEnoughGPUs, match="trainer0 and trainer1 would share a GPU.*gloo"):
        gpus.place(processes(HYBRID), ["7"])
    # Over gloo they may share it.
    gloo = {**HYBRID, "spec": {**HYBRID["spec"], "backend": "gloo"}}
    shared = gpus.place(processes(gloo), ["7"])
    assert set(shared.visible.values()) == {"7"} and "share them" in (shared.note or "")


# ------------------------------------------------------------------ the runner


SHOW_GPUS = "import os; print('sees', os.environ.get('CUDA_VISIBLE_DEVICES', 'all'))"


@pytest.mark.timeout(60)
def test_the_runner_gives_each_process_its_gpus_and_says_when_they_share(monkeypatch):
    import pipejob.runner.local as local

    monkeypatch.setattr(local, "TRAINER_MODULE", ("-c", SHOW_GPUS))  # a stand-in trainer
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    job = spec.parse(pipeline_job("share", stages=2, gpusPerStage=1))
    out = io.StringIO()
    assert run_job(job, grace=5, out=out, detect_gpus=lambda: ["0"]) == 0
    text = out.getvalue()
    notes = [line for line in text.splitlines() if "share them" in line]
    assert notes == [
        "pipejob: the job asks for 2 GPUs and this machine has 1 GPU: its"
        " processes share them (stage0, stage1 on CUDA_VISIBLE_DEVICES=0), which"
        " trains, but slower"
    ], text
    assert re.search(r"^master\s*\| sees all$", text, re.M), text
    assert len(re.findall(r"^stage[01]\s*\| sees 0$", text, re.M)) == 2, text


def test_engine_auto_on_shared_gpus_runs_on_rpc_and_says_why():
    """The pipelining engine's stages form one NCCL group (pipe), which one GPU cannot seat:
    `engine: auto` runs the rpc engine there, whose stages share it; `pipelining` is refused."""
    auto = spec.parse(pipeline_job("a", stages=2, microBatches=2, gpusPerStage=1, engine="auto"))
    processes, _, placement, notes = placed(auto, lambda: ["0"])
    assert notes[0] == (
        "engine auto runs on rpc: its stages share GPUs here, which the pipelining engine cannot"
    )
    assert [p.seat for p in processes] == [None, None, None]  # no pipe group: rpc's world
    assert json.loads(processes[1].env["PIPEJOB_SPEC"])["engine"] == "rpc"
    assert set(placement.visible.values()) == {"0"}
    processes, _, _, notes = placed(auto, lambda: ["0", "1"])  # a GPU each: as asked
    assert notes == [] and json.loads(processes[1].env["PIPEJOB_SPEC"])["engine"] == "auto"
    pipelining = spec.parse(
        pipeline_job("p", stages=2, microBatches=2, gpusPerStage=1, engine="pipelining")
    )
    with pytest.raises(gpus.NotEnoughGPUs, match="NCCL cannot run two members of one group"):
        placed(pipelining, lambda: ["0"])


@pytest.mark.timeout(60)
def test_the_runner_refuses_before_starting_anything(monkeypatch, tmp_path):
    import pipejob.runner.local as local

    monkeypatch.setattr(local, "TRAINER_MODULE", ("-c", SHOW_GPUS))
    out = io.StringIO()
    assert run_job(spec.parse(HYBRID), grace=5, out=out, detect_gpus=lambda: ["0"]) == 2
    text = out.getvalue()
    assert "started" not in text and "sees" not in text, text
    assert re.search(
        r"^pipejob: cannot run HybridJob 'h' here: trainer0 and trainer1 would"
        r" share a GPU: .*backend: gloo$",
        text,
        re.M,
    ), text
    # The manifest as users write it, through the CLI, on this machine without GPUs.
    path = tmp_path / "h.yaml"
    path.write_text(yaml.safe_dump(HYBRID))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    from pipejob.cli import main as cli

    assert cli.main(["run", str(path)]) == 2
