"""HybridJob end to end: `pipejob run` starts the master, parameter servers and DDP trainers
on loopback."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import recsys_reference as reference
import torch

from jobrun import run_to_end
from pipejob.core import spec as specs
from pipejob.core.kinds import tables
from pipejob.trainer.hybrid.model_writer import export_checkpoint
from pipejob.trainer.runtime import checkpoint
from pipejob.trainer.workloads.recsys import initial_rows

TINY = {
    "apiVersion": "pipejob.dev/v1alpha1",
    "kind": "HybridJob",
    "metadata": {"name": "tiny-hybrid"},
    "spec": {
        "trainers": 2,
        "embedding": {"numEmbeddings": 64, "dim": 8, "mode": "sum"},
        "dense": {"outFeatures": 4},
        "steps": 40,
        "batchSize": 8,
        "bagSize": 4,
        "datasetSize": 101,  # odd: epochs end inside a step's batch (40 x 16 > 6 epochs)
        "optimizer": {"name": "sgd", "lr": 0.2, "momentum": 0.5},
        "logEvery": 10,
        "seed": 3,
        "rendezvousTimeoutSeconds": 60,
    },
}


@pytest.mark.slow  # the split tables' float64 test below trains two trainers exactly
@pytest.mark.timeout(200)
def test_two_trainers_train_with_identical_dense_weights_and_disjoint_data(tmp_path: Path) -> None:
    code, output, summary = run_to_end(TINY, tmp_path, timeout=170)
    assert code == 0, output
    assert summary is not None, output
    spec = TINY["spec"]

    # Progress on the master, then its summary.
    for step in (10, 20, 30, 40):
        assert re.search(
            rf"^master\s*\| step {step}/40 +loss [\d.]+ +[\d,]+ samples/s$", output, re.M
        ), output
    assert re.search(r"^master\s*\| done: 40 steps x 8 bags on 2 trainer", output, re.M), output
    assert summary["trainers"] == 2 and summary["steps"] == 40
    assert summary["samplesPerSecond"] > 0
    # Every process's peak memory: torch alone keeps over 50 MB resident; none nears 20 GB.
    memory = summary["memory"]
    assert list(memory) == ["master", "ps0", "trainer0", "trainer1"], memory
    assert all(50e6 < m["rssPeakBytes"] < 20e9 for m in memory.values()), memory
    assert re.search(
        r"^master\s*\| peak memory: master \d+ MB, ps0 \d+ MB, trainer0 \d+ MB,"
        r" trainer1 \d+ MB$",
        output,
        re.M,
    ), output

    # DDP kept the dense replicas identical, and they did train.
    assert summary["denseMaxAbsDiff"] == 0.0
    trainers = summary["perTrainer"]
    assert list(trainers) == ["trainer0", "trainer1"]
    assert all(t["denseChangeNorm"] > 0 for t in trainers.values())

    # The trainers' gradients reached the parameter server's table, which stepped.
    assert summary["embeddingChangeNorm"] > 0
    assert summary["perServer"]["ps0"]["steps"] == 40

    # The task is learnable: the loss falls.
    assert summary["finalLoss"] < 0.7 * summary["firstLoss"], summary

    # Each trainer read its half of every step's batch, and no sample twice in an epoch.
    assert summary["samplesRepeated"] == 0
    assert [t["share"] for t in trainers.values()] == [spec["batchSize"]] * 2


def hybrid_job(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": name},
        "spec": spec,
    }


# Two servers and two trainers; "wide" is larger than a share, so it is split row-wise
# across both servers; two tables share a feature; every pooling mode.
EXACT = hybrid_job(
    "exact-hybrid",
    {
        "trainers": 2,
        "parameterServers": 2,
        "embeddings": [
            {"name": "wide", "rows": 3000, "dim": 4, "mode": "sum"},
            {"name": "narrow", "rows": 40, "dim": 4, "mode": "mean", "feature": "wide"},
            {"name": "peak", "rows": 60, "dim": 4, "mode": "max"},
        ],
        "dense": {"dlrm": {"bottom": [8], "top": [8]}},
        "denseFeatures": 3,
        "sparseOptimizer": {"name": "adagrad", "lr": 0.1},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "steps": 3,
        "batchSize": 8,
        "bagSize": 5,
        "datasetSize": 64,
        "seed": 4,
        "rendezvousTimeoutSeconds": 60,
        "preflight": {"megabytes": 0.5},
    },
)

# Every process of the world computes in float64: the runner puts the manifest's folder first
# on PYTHONPATH, and Python imports this file from there as it starts.
FLOAT64 = """import os
if "PIPEJOB_ROLE" in os.environ:  # a member of the world, not the runner
    import torch
    torch.set_default_dtype(torch.float64)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("in_trainers", [False, True], ids=["own-pods", "in-trainers"])
def test_a_split_tables_updates_equal_one_process_s_in_float64(
    tmp_path: Path, in_trainers: bool
) -> None:
    """The servers step the rows each step touched, once, with the trainers' averaged
    sparse gradients: after every step the tables (their pieces joined), their Adagrad state
    and the dense part equal one nn.Module of EmbeddingBag(sparse=True) tables stepped by the
    same optimizers on both trainers' batches together, to float64's rounding; with the
    servers in their own processes or in the trainers' (a trainer's own server called
    directly, its checkpoint files named the same)."""
    (tmp_path / "sitecustomize.py").write_text(FLOAT64)
    saved = {"checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 1}}
    manifest = EXACT | {"spec": EXACT["spec"] | saved | {"serversInTrainers": in_trainers}}
    code, output, summary = run_to_end(manifest, tmp_path, timeout=170)
    assert code == 0, output
    processes = ["master", *([] if in_trainers else ["ps0", "ps1"]), "trainer0", "trainer1"]
    assert list(summary["memory"]) == processes, output  # no servers' processes in trainers
    spec = specs.parse(EXACT).settings
    assert [[(p.table, p.start, p.stop) for p in s] for s in spec.placement()] == [
        [("wide", 0, 1500), ("peak", 0, 60)],
        [("narrow", 0, 40), ("wide", 1500, 3000)],
    ]
    for step in (2, 3):  # the checkpoints kept: those of the last two steps
        directory = checkpoint.step_dir(tmp_path / "ckpt", step)
        saved = [torch.load(directory / f"ps{i}.pt") for i in (0, 1)]
        assert {s["optimizer"] for s in saved} == {"adagrad"}
        pieces = [p for s in saved for p in s["pieces"]]
        torch.set_default_dtype(torch.float64)
        try:
            model, optimizer = reference.trained(spec, step)
        finally:
            torch.set_default_dtype(torch.float32)
        for t in spec.embeddings:
            got = reference.assembled(pieces, t.name, t.rows)
            weight = model.tables[t.name].weight
            assert got["weight"].dtype == torch.float64
            torch.testing.assert_close(got["weight"], weight.detach(), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(
                got["sum"], optimizer.state[weight]["sum"], rtol=1e-12, atol=1e-14
            )
        dense = torch.load(directory / "dense.pt", weights_only=False)["model"]
        for name, value in model.dense.state_dict().items():
            torch.testing.assert_close(dense[name], value, rtol=1e-12, atol=1e-14, msg=name)
    # Each server stepped every step, on a few of its rows only.
    assert all(s["steps"] == 3 for s in summary["perServer"].values()), summary["perServer"]
    assert 0 < sum(s["rowsUpdated"] for s in summary["perServer"].values()) < 3 * 3100


# EXACT with two of its tables replicated on the trainers (a mean and a max one: every way a
# trainer pools them); "wide" stays split over the servers.
REPLICATED = [
    t | {"placement": "replicated"} if t["name"] != "wide" else t
    for t in EXACT["spec"]["embeddings"]
]


@pytest.mark.timeout(400)
def test_replicated_tables_step_on_the_trainers_as_one_process_does_in_float64(
    tmp_path: Path,
) -> None:
    """Tables replicated on the trainers (no server holds them) are stepped on every trainer
    by the sparse optimizer with the trainers' averaged gradients, checkpointed with their
    optimizer state and resumed: after 3 steps, then 2 more in a run that resumes, the model
    file's tables (the replicated ones from a trainer, the split one from the servers) and
    dense part equal one process's after 5, to float64's rounding."""
    (tmp_path / "sitecustomize.py").write_text(FLOAT64)
    ckpt = {"path": str(tmp_path / "ckpt"), "everySteps": 3}
    body = EXACT["spec"] | {"embeddings": REPLICATED, "checkpoint": ckpt}
    code, output, _ = run_to_end(EXACT | {"spec": body}, tmp_path, timeout=170)
    assert code == 0, output
    out = {"path": str(tmp_path / "out"), "format": "torch"}
    manifest = EXACT | {"spec": body | {"steps": 5, "output": out}}
    code, output, summary = run_to_end(manifest, tmp_path, timeout=170)
    assert code == 0, output
    assert summary["resumedFromStep"] == 3, output
    assert summary["denseMaxAbsDiff"] == 0.0  # the trainers' copies, dense part and tables
    spec = specs.parse(manifest).settings
    assert [[p.table for p in s] for s in spec.placement()] == [["wide"], ["wide"]]
    state = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    torch.set_default_dtype(torch.float64)
    try:
        model, _ = reference.trained(spec, spec.steps)
    finally:
        torch.set_default_dtype(torch.float32)
    for name, value in model.state_dict().items():
        assert state[name].dtype == torch.float64, name
        torch.testing.assert_close(state[name], value, rtol=1e-12, atol=1e-14, msg=name)
    for t in spec.embeddings[1:]:  # the replicated tables did move
        moved = state[f"tables.{t.name}.weight"] - initial_rows(t, spec.seed, 0, t.rows).double()
        assert moved.abs().max() > 1e-3, t.name
    # The last checkpoint (after step 5) exports to the same model, replicated tables too.
    found = checkpoint.latest(tmp_path / "ckpt")
    assert found is not None and found.step == 5
    export_checkpoint(found.directory, found.manifest, tmp_path / "exported", "torch")
    exported = torch.load(tmp_path / "exported" / "model.pt", weights_only=True)
    assert sorted(exported) == sorted(state)
    assert all(torch.equal(exported[k], v) for k, v in state.items())


# 1.4 GB of one table: more than a pod's 1200Mi limit holds, a quarter of it well under.
HUGE_ROWS, LIMIT = 21_875_000, 1200 * 2**20
HUGE = hybrid_job(
    "huge-table",
    {
        "trainers": 1,
        "parameterServers": 4,
        "embeddings": [
            {"name": "huge", "rows": HUGE_ROWS, "dim": 16},
            {"name": "small", "rows": 1000, "dim": 16},
        ],
        "denseFeatures": 2,
        "dense": {"dlrm": {"bottom": [8], "top": [8]}},
        "steps": 4,
        "batchSize": 16,
        "datasetSize": 64,
        "logEvery": 2,
        "template": {"resources": {"limits": {"memory": "1200Mi"}}},
        "rendezvousTimeoutSeconds": 60,
        "preflight": {"megabytes": 0.5},
    },
)


@pytest.mark.timeout(300)
def test_a_table_too_big_for_one_server_trains_split_across_four_each_under_its_limit(
    tmp_path: Path,
) -> None:
    """One server could not hold the table: the spec is refused before anything starts, and
    the advice is four (two peaked at 1.51-1.53 GB, over the limit: the estimate counts what
    the process holds besides its tables). Four hold a quarter each, and each one's peak
    resident memory (what a memory limit counts, torch and the process itself included)
    stays under the plan's estimate and the pods' limit."""
    one = HUGE | {"spec": HUGE["spec"] | {"parameterServers": 1}}
    with pytest.raises(
        specs.InvalidSpec,
        match=r"spec\.parameterServers: ps0 would hold 1\.4 GB"
        r" of tables .* over the pods' memory limit"
        r" 1200Mi .*: use 4 parameterServers",
    ):
        specs.parse(one)
    code, output, summary = run_to_end(HUGE, tmp_path, timeout=270)
    assert code == 0, output
    share = HUGE_ROWS * 16 * 4 // 4
    peaks = {name: m["rssPeakBytes"] for name, m in summary["memory"].items()}
    servers = {name: peak for name, peak in peaks.items() if name.startswith("ps")}
    assert sorted(servers) == ["ps0", "ps1", "ps2", "ps3"], peaks
    assert all(share < peak < LIMIT for peak in servers.values()), (share, peaks)
    spec = specs.parse(HUGE).settings
    held = tables.fullest(spec.embeddings, 4, spec.sparse_optimizer.name)[1]
    assert all(peak < tables.server_needs(held) for peak in servers.values()), (held, peaks)
    assert peaks["trainer0"] < tables.trainer_needs(1), peaks
    # Each holds its quarter: well above a trainer, which holds no table.
    assert all(peak - peaks["trainer0"] > share // 2 for peak in servers.values()), peaks
    assert all(s["steps"] == 4 for s in summary["perServer"].values())
    print(f"\n[peak memory] {peaks} (each server's share of the table: {share} bytes)")
