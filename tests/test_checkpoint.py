"""Checkpoints: atomic files and manifests, optimizer state, and whole worlds that are killed
and resume (real processes on loopback)."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from jobrun import (
    JobRun,
    assert_fits,
    assert_states_close,
    by_parameter,
    final_state,
    pipeline_job,
)
from pipejob.core.common_spec import Optimizer, from_spec
from pipejob.core.spec import parse
from pipejob.trainer.runtime import checkpoint, checkpoint_format
from pipejob.trainer.runtime.optim import Functional

# ------------------------------------------------------------------ files and manifests


def make_checkpoint(root: Path, step: int, parts: dict[str, Any]) -> list[dict[str, Any]]:
    directory = checkpoint.step_dir(root, step)
    files = [checkpoint.save_part(directory, name, state) for name, state in parts.items()]
    checkpoint.write_manifest(root, step, files, kind="PipelineJob", job="unit")
    return files


def test_a_part_round_trips_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0).view(2, 3), "step": 3}
    entry = checkpoint.save_part(tmp_path, "stage0.pt", state)
    assert entry["bytes"] == (tmp_path / "stage0.pt").stat().st_size
    loaded = checkpoint.load_part(tmp_path, entry)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage0.pt"]


def test_a_write_that_fails_halfway_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "part.pt"
    checkpoint.write_atomic(path, lambda f: f.write(b"old complete content"))

    def crash(f) -> None:
        f.write(b"new but")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoint.write_atomic(path, crash)
    assert path.read_bytes() == b"old complete content"
    assert [p.name for p in tmp_path.iterdir()] == ["part.pt"]


def test_an_interrupted_checkpoint_is_never_used(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8, 10):
        parts = {"master.pt": {"step": step}, "stage0.pt": {"w": torch.full((64,), float(step))}}
        make_checkpoint(tmp_path, step, parts)
    # 10: a part was rewritten after the manifest (same size, other bytes).
    part = checkpoint.step_dir(tmp_path, 10) / "stage0.pt"
    data = bytearray(part.read_bytes())
    data[-100] ^= 0xFF
    part.write_bytes(bytes(data))
    # 8: a part is truncated (the manifest was written, the part's write was not durable).
    part = checkpoint.step_dir(tmp_path, 8) / "stage0.pt"
    part.write_bytes(part.read_bytes()[:100])
    # 6: the manifest was never written (a crash while the stages were saving).
    (checkpoint.step_dir(tmp_path, 6) / checkpoint.MANIFEST).unlink()
    # 4: complete, with a leftover temporary file of a crashed write next to it.
    (checkpoint.step_dir(tmp_path, 4) / ".stage0.pt.tmp-4242").write_bytes(b"partial")
    # 12: only a stage's part exists.
    checkpoint.save_part(checkpoint.step_dir(tmp_path, 12), "stage0.pt", {"w": 1})

    passed: list[str] = []
    found = checkpoint.latest(tmp_path, passed.append)
    assert found is not None and found.step == 4
    assert torch.equal(found.load("stage0.pt")["w"], torch.full((64,), 4.0))
    assert [re.sub(r".*/(step-\d+) is not used: ", r"\1: ", m) for m in passed] == [
        "step-00000012: no manifest (its writing never finished)",
        "step-00000010: stage0.pt: its SHA-256 differs from the manifest's",
        "step-00000008: stage0.pt: 100 bytes, the manifest says "
        f"{found.entry('stage0.pt')['bytes']} (truncated or replaced)",
        "step-00000006: no manifest (its writing never finished)",
    ]
    with pytest.raises(checkpoint.CheckpointError, match="truncated"):
        checkpoint.load_part(checkpoint.step_dir(tmp_path, 8), found.entry("stage0.pt"))


def test_a_manifest_is_its_typed_format_with_the_head_first(tmp_path: Path) -> None:
    """manifest.json as checkpoint_format declares it: the head, the files as listed (a
    module file's names go to the index, not its entry), then the kind's fields."""
    module = torch.nn.Linear(2, 2)
    directory = checkpoint.step_dir(tmp_path, 3)
    files = [
        checkpoint.save_part(directory, "master.pt", {"rng": checkpoint.rng_state()}),
        checkpoint.save_module(directory, "stage0.pt", module, {}),
    ]
    assert_fits(files[1], checkpoint_format.FileEntry)
    assert files[1]["holds"] == ["weight", "bias"]
    checkpoint.write_manifest(tmp_path, 3, files, kind="PipelineJob", job="unit", stageCount=1)
    written = json.loads((directory / checkpoint.MANIFEST).read_text())
    head = ["format", "step", "time", "files", "index"]
    assert list(written) == [*head, "kind", "job", "stageCount"]
    assert_fits(written, checkpoint_format.Manifest)
    assert [list(f) for f in written["files"]] == [["name", "bytes", "sha256"]] * 2
    assert written["index"] == {"weight": "stage0.pt", "bias": "stage0.pt"}
    found = checkpoint.latest(tmp_path)
    assert found is not None and found.manifest == written
    assert_fits(found.load("stage0.pt")["rng"], checkpoint_format.RngState)


def test_no_checkpoint_yet(tmp_path: Path) -> None:
    assert checkpoint.latest(tmp_path / "absent") is None
    assert checkpoint.latest(tmp_path) is None


def test_a_manifest_needs_every_part_where_the_master_sees_it(tmp_path: Path) -> None:
    entry = checkpoint.save_part(tmp_path / "elsewhere", "stage1.pt", {"w": 1})
    with pytest.raises(
        checkpoint.CheckpointError,
        match="stage1.pt: missing, as the master sees it .* shared by every process",
    ):
        checkpoint.write_manifest(tmp_path, 4, [entry])
    assert checkpoint.latest(tmp_path) is None


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        make_checkpoint(tmp_path, step, {"master.pt": {}})
    (checkpoint.step_dir(tmp_path, 3) / checkpoint.MANIFEST).unlink()  # incomplete, older
    checkpoint.save_part(checkpoint.step_dir(tmp_path, 5), "stage0.pt", {})  # in progress
    checkpoint.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000002",
        "step-00000004",
        "step-00000005",
    ]


def test_due_every_n_steps_and_at_the_last() -> None:
    every = parse(pipeline_job("c", steps=7, checkpoint={"path": "/x", "everySteps": 3}))
    assert [s for s in range(1, 8) if checkpoint.due(every.settings, s)] == [3, 6, 7]
    never = parse(pipeline_job("c", steps=7)).settings
    assert not any(checkpoint.due(never, s) for s in range(1, 8))


# ------------------------------------------------------------------ optimizer state


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "rmsprop", "nadam"])
def test_optimizer_state_survives_a_checkpoint(name: str) -> None:
    """A stage's optimizer (optim.Functional) and a plain torch.optim one (NAdam, as a
    HybridJob trainer's), saved by name after step 1 and loaded into a fresh one: it
    continues exactly as the original does; a fresh state does not."""
    spec = from_spec(
        Optimizer,
        {
            "name": "sgd" if name == "nadam" else name,
            "lr": 0.1,
            "momentum": 0.5,
            "weightDecay": 0.0,
        },
    )

    def optimizer(model: torch.nn.Module) -> Any:
        if name == "nadam":
            return torch.optim.NAdam(model.parameters(), lr=0.1)
        return Functional(spec, model.named_parameters())

    def step(model: torch.nn.Module, opt: Any) -> None:
        model.zero_grad()
        (model(x) ** 2).sum().backward()
        opt.step()

    torch.manual_seed(0)
    x = torch.randn(4, 3)
    a = torch.nn.Linear(3, 2)
    opt_a = optimizer(a)
    step(a, opt_a)
    saved = checkpoint.optimizer_state(opt_a, a)
    assert sorted(saved) == ["bias", "weight"]
    weights = {k: v.clone() for k, v in a.state_dict().items()}
    for _ in range(3):
        step(a, opt_a)
    for restore in (True, False):
        b = torch.nn.Linear(3, 2)
        b.load_state_dict(weights)
        opt_b = optimizer(b)
        if restore:
            checkpoint.load_optimizer_state(opt_b, b, saved)
        for _ in range(3):
            step(b, opt_b)
        differ = max(
            (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
        )
        assert differ == 0.0 if restore else differ > 1e-4, (restore, differ)


# ------------------------------------------------------------------ worlds that resume

PIPELINE = pipeline_job(
    "resume",
    stages=2,
    microBatches=2,
    steps=8,
    seed=1,
    optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.9},
    preflight={"megabytes": 0.5},
)


def with_checkpoint(manifest: dict[str, Any], path: Path, every: int) -> dict[str, Any]:
    return manifest | {
        "spec": manifest["spec"] | {"checkpoint": {"path": str(path), "everySteps": every}}
    }


@pytest.mark.timeout(420)
def test_a_pipeline_world_killed_after_a_step_resumes_and_matches(tmp_path: Path) -> None:
    steps = PIPELINE["spec"]["steps"]
    straight = with_checkpoint(PIPELINE, tmp_path / "straight", every=2)
    with JobRun(straight, tmp_path, "straight") as run:
        assert run.finish(200) == 0, run.output

    broken = with_checkpoint(PIPELINE, tmp_path / "broken", every=2)
    with JobRun(broken, tmp_path, "broken") as run:
        run.wait_for(r"^master\s*\| step 3/8 ", timeout=200)
        os.kill(run.pid("stage1"), signal.SIGKILL)
        assert run.finish(60) != 0, run.output
        assert "stage1 (role stage, rank 2) failed: killed by signal SIGKILL" in run.output
        k = max(int(s) for s in re.findall(r"^master\s*\| step (\d+)/8 ", run.output, re.M))
    newest = checkpoint.latest(tmp_path / "broken")
    assert newest is not None and newest.step <= k
    assert_fits(newest.manifest, checkpoint_format.Manifest)  # a real master's, its fields

    # The same manifest again: the restarted world.
    with JobRun(broken, tmp_path, "broken") as run:
        assert run.finish(200) == 0, run.output
        output, summary = run.output, run.summary()
    assert re.search(rf"^master\s*\| resumed from step {newest.step} \(", output, re.M), output
    trained = [int(s) for s in re.findall(r"^master\s*\| step (\d+)/8 ", output, re.M)]
    assert trained == list(range(newest.step + 1, steps + 1)), output
    assert summary["resumedFromStep"] == newest.step
    assert summary["steps"] == steps - newest.step == len(summary["losses"])
    assert_states_close(
        by_parameter(final_state(tmp_path / "broken", steps)),
        by_parameter(final_state(tmp_path / "straight", steps)),
    )


HYBRID = {
    "apiVersion": "pipejob.dev/v1alpha1",
    "kind": "HybridJob",
    "metadata": {"name": "resume-hybrid"},
    "spec": {
        "trainers": 1,
        "embedding": {"numEmbeddings": 64, "dim": 8},
        "dense": {"outFeatures": 4},
        "steps": 8,
        "batchSize": 8,
        "bagSize": 4,
        "datasetSize": 40,
        "seed": 2,
        "optimizer": {"name": "sgd", "lr": 0.2, "momentum": 0.9},
        "sparseOptimizer": {"name": "adagrad", "lr": 0.2},
        "rendezvousTimeoutSeconds": 60,
        "preflight": {"megabytes": 0.5},
    },
}


@pytest.mark.slow  # the hybrid world resumed twice in test_operator_faults_e2e.py
@pytest.mark.timeout(300)
def test_a_hybrid_world_resumes_table_dense_layer_and_momentum(tmp_path: Path) -> None:
    straight = with_checkpoint(HYBRID, tmp_path / "straight", every=4)
    broken = with_checkpoint(HYBRID, tmp_path / "broken", every=4)
    for manifest, name in ((straight, "straight"), (broken, "broken")):
        with JobRun(manifest, tmp_path, name) as run:
            assert run.finish(120) == 0, run.output
    # The world died while completing step 8's checkpoint: the master never wrote the
    # manifest, and the parameter server's part was only half written.
    last = checkpoint.step_dir(tmp_path / "broken", 8)
    (last / checkpoint.MANIFEST).unlink()
    (last / "ps0.pt").write_bytes((last / "ps0.pt").read_bytes()[:64])

    with JobRun(broken, tmp_path, "broken") as run:
        assert run.finish(120) == 0, run.output
        output, summary = run.output, run.summary()
    assert re.search(
        r"^master\s*\| checkpoint .*step-00000008 is not used: no manifest", output, re.M
    ), output
    assert re.search(r"^master\s*\| resumed from step 4 \(", output, re.M), output
    assert summary["resumedFromStep"] == 4
    assert summary["perTrainer"]["trainer0"]["steps"] == 4
    got, expected = final_state(tmp_path / "broken", 8), final_state(tmp_path / "straight", 8)
    assert sorted(got) == ["dense.pt", "master.pt", "ps0.pt"]
    assert_states_close(got, expected)
    # The table and its Adagrad state (kept once per table, by table and rows) resumed too.
    [piece] = expected["ps0.pt"]["pieces"]
    assert (piece["table"], piece["start"], piece["stop"]) == ("embedding", 0, 64)
    [resumed] = got["ps0.pt"]["pieces"]
    for key in ("weight", "sum"):
        value = piece["weight"] if key == "weight" else piece["state"][key]
        again = resumed["weight"] if key == "weight" else resumed["state"][key]
        torch.testing.assert_close(again, value, rtol=1e-4, atol=1e-6, msg=key)
