"""Profiles: a profiled step of real worlds gives one valid Chrome trace per process, with the
driver's RPC calls and the ops they ran remotely."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest

from jobrun import JobRun, pipeline_job
from pipejob.core.spec import parse
from pipejob.trainer.runtime import profiling


def trace(path: Path) -> list[dict[str, Any]]:
    """The events of a Chrome trace file, checked to be one."""
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    assert events and all("ph" in e and "pid" in e for e in events), path
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], int | float), e
    return events


def names(events: list[dict[str, Any]]) -> set[str]:
    return {e["name"] for e in events if e["ph"] == "X"}


def assert_rpc_lanes_within_the_step(events: list[dict[str, Any]]) -> None:
    """The RPC events sit in their own lanes, inside the time the step's ops span."""
    ops = [e for e in events if e["ph"] == "X" and e.get("cat") != "rpc"]
    rpcs = [e for e in events if e["ph"] == "X" and e.get("cat") == "rpc"]
    assert rpcs and all(e["tid"] >= profiling.RPC_LANE for e in rpcs)
    start, end = min(e["ts"] for e in ops), max(e["ts"] + e["dur"] for e in ops)
    slack = 5_000  # us: the two profilers' clocks are matched through the wall clock
    assert all(start - slack <= e["ts"] <= end + slack for e in rpcs)


@pytest.mark.timeout(240)
def test_a_profiled_pipeline_step_traces_every_process(tmp_path: Path) -> None:
    job = pipeline_job(
        "profiled",
        engine="rpc",  # its calls are the rpc engine's (on_stage, passed_on)
        stages=2,
        microBatches=2,
        steps=2,
        preflight={"megabytes": 0.5},
        checkpoint={"path": str(tmp_path / "ck")},
        profile={"steps": [2], "rowLimit": 7},
    )
    with JobRun(job, tmp_path) as run:
        assert run.finish(200) == 0, run.output
        output = run.output
    directory = tmp_path / "ck" / "profiles"  # the default: under the checkpoint path
    assert sorted(p.name for p in directory.iterdir()) == [
        "master-step2.json",
        "stage0-step2.json",
        "stage1-step2.json",
    ]

    master = trace(directory / "master-step2.json")
    rpc = names(master)
    assert "rpc_sync#on_stage(master -> stage0)" in rpc  # the step: one call to stage0
    # The remote ops of a call come back with its reply, but torch sometimes leaves them out
    # while the callee records its own trace (see the user guide): they must come back for
    # some of the step's calls to the stages; each call itself is always there, and its ops
    # are in its stage's trace (below).
    assert any(
        re.match(r"rpc_(sync|async)#on_stage\(master -> stage[01]\)#remote_op: aten::", n)
        for n in rpc
    )
    assert_rpc_lanes_within_the_step(master)

    for stage in ("stage0", "stage1"):
        ops = names(trace(directory / f"{stage}-step2.json"))
        assert "aten::convolution" in ops and "aten::convolution_backward" in ops, stage
        # Distributed autograd's RPC nodes: the gradient of what stage0 sent arrives there,
        # and stage1, where the backward starts, sends it back from what it received.
        node = "SendRpcBackward" if stage == "stage0" else "RecvRpcBackward"
        assert f"torch::distributed::autograd::{node}" in ops, (stage, sorted(ops))
        assert any(n.startswith("optimizer step (") for n in ops), stage  # the step it ran
    # The first stage passes each micro-batch on to the next itself and steps the others'
    # optimizers, and the last stage asks the first stage's reader for the round's labels.
    first = names(trace(directory / "stage0-step2.json"))
    assert {
        "rpc_async#passed_on(stage0 -> stage1)",
        "rpc_async#on_stage(stage0 -> stage1)",
    } <= first
    assert "rpc_async#on_reader(stage1 -> stage0)" in names(trace(directory / "stage1-step2.json"))

    # Each process logs its key_averages table, the master also its RPC table.
    for name in ("master", "stage0", "stage1"):
        assert re.search(rf"^{name}\s*\| profile of step 2, all threads \(", output, re.M), name
        assert re.search(rf"^master\s*\| profile: wrote .*/{name}-step2.json", output, re.M)
    assert re.search(
        r"^master\s*\| RPC calls \(1 of 1\) and the ops they ran remotely", output, re.M
    )
    # The master's lines only: the stages' output may come between them.
    own = "".join(line + "\n" for line in output.splitlines() if line.startswith("master"))
    table = re.search(
        r"^master\s*\| RPC calls \(1 of 1\).*\n((?:master.*\n)+?)master\s*\| Self", own, re.M
    )
    assert table is not None
    # Its rows (RPC calls, with `#`, and the master's parts of the step), as many as rowLimit
    # at most; the header's "# of Calls" is not one.
    rows = [line for line in table[1].splitlines() if re.search(r"#\S|pipejob: ", line)]
    assert 1 <= len(rows) <= 7, table[1]
    # The master's parts of the step, in the order they began, each with its time.
    parts = re.search(
        r"^master\s*\| profile of step 2, its parts: (.*) \(of ([\d.]+) ms\)$", output, re.M
    )
    assert parts is not None, output
    said = dict(re.findall(r"([a-z][a-z -]*?) ([\d.]+) ms", parts[1].replace(",", "")))
    # One call a step: the first stage reads step 2's round in its first forward, the last
    # computes the loss and runs the backward, the others settle as its reply passes back,
    # and the first stage steps every stage's optimizer; the master only judges.
    assert list(said)[:2] == ["forwards and backward", "gradient norms"], said
    assert "optimizer step" not in said, said
    assert sum(float(v) for v in said.values()) <= float(parts[2]) + 0.5, parts[0]


@pytest.mark.slow  # the rpc engine's profiled step above holds the profiler's path
@pytest.mark.timeout(240)
def test_a_profiled_pipelining_step_traces_the_schedule_on_every_stage(tmp_path: Path) -> None:
    """On the pipelining engine a stage's trace holds its schedule's work: the forwards and
    backwards, and the activations and gradients it sends and receives over its group."""
    job = pipeline_job(
        "profiled",
        engine="pipelining",
        stages=2,
        microBatches=2,
        steps=2,
        preflight={"enabled": False},
        profile={"steps": [2], "rowLimit": 5, "path": str(tmp_path / "traces")},
    )
    with JobRun(job, tmp_path) as run:
        assert run.finish(200) == 0, run.output
    directory = tmp_path / "traces"
    assert sorted(p.name for p in directory.iterdir()) == [
        "master-step2.json",
        "stage0-step2.json",
        "stage1-step2.json",
    ]
    assert "rpc_async#on_stage(master -> stage1)" in names(trace(directory / "master-step2.json"))
    for stage, passes in (("stage0", "gloo:send"), ("stage1", "gloo:recv")):
        ops = names(trace(directory / f"{stage}-step2.json"))
        assert "aten::convolution" in ops and "aten::convolution_backward" in ops, stage
        assert passes in ops, (stage, sorted(o for o in ops if "gloo" in o))


@pytest.mark.slow  # the profiler's path is the pipeline tests' above
@pytest.mark.timeout(200)
def test_profiled_hybrid_steps_trace_every_process(tmp_path: Path) -> None:
    job = {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": "profiled-hybrid"},
        "spec": {
            "trainers": 2,
            "embedding": {"numEmbeddings": 64, "dim": 8},
            "dense": {"outFeatures": 4},
            "steps": 4,
            "batchSize": 8,
            "bagSize": 4,
            "datasetSize": 64,
            "rendezvousTimeoutSeconds": 60,
            "preflight": {"megabytes": 0.5},
            "profile": {"steps": [2, 3], "path": str(tmp_path / "traces")},
        },
    }
    with JobRun(job, tmp_path) as run:
        assert run.finish(150) == 0, run.output
    directory = tmp_path / "traces"
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        f"{name}-step{step}.json"
        for name in ("master", "ps0", "trainer0", "trainer1")
        for step in (2, 3)
    )
    remote_ops = []
    for k, step in itertools.product((0, 1), (2, 3)):
        events = trace(directory / f"trainer{k}-step{step}.json")
        ops = names(events)
        # The call to the parameter server (the last step's gradients through its pooling,
        # this step's lookup), and the dense layer's local optimizer step.
        assert f"rpc_async#exchange(trainer{k} -> ps0)" in ops
        remote_ops.append(
            f"rpc_async#exchange(trainer{k} -> ps0)#remote_op: EmbeddingBagBackward0" in ops
        )
        assert "Optimizer.step#SGD.step" in ops
        assert "AddmmBackward0" in ops  # the dense layer's backward: the whole step, not the RPCs
        assert_rpc_lanes_within_the_step(events)
    # torch sometimes leaves a call's remote ops out while the ps profiles too (see the
    # user guide); they must come back at all.
    assert any(remote_ops)
    for step in (2, 3):
        ps = names(trace(directory / f"ps0-step{step}.json"))
        assert "aten::embedding_bag" in ps and "EmbeddingBagBackward0" in ps
        # The table's sparse step runs on the ps, once both trainers' gradients are in.
        assert "Optimizer.step#SGD.step" in ps
        trace(directory / f"master-step{step}.json")  # it only takes reports; still a trace


def test_settings_default_to_the_checkpoint_path() -> None:
    def settings(**fields: Any) -> Any:
        return profiling.settings(parse(pipeline_job("p", **fields)).settings)

    s = settings(checkpoint={"path": "/ck"}, profile={"steps": [2, 5], "rowLimit": 9})
    assert s == profiling.ProfileSettings(frozenset({2, 5}), Path("/ck/profiles"), 9)
    assert settings(profile={"steps": [1], "path": "/p", "rowLimit": 3}).path == Path("/p")
    assert settings() is None
    assert profiling.trace_path("/p", "stage1", 5) == Path("/p/stage1-step5.json")
