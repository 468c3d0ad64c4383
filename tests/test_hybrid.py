"""HybridJob end to end: `pipejob run` starts master, ps and two DDP trainers on loopback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from jobrun import run_to_end
from pipejob.core import spec as specs
from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.trainer.hybrid.ps import Table
from pipejob.trainer.runtime import checkpoint
from pipejob.trainer.runtime.optim import optimizer_args
from pipejob.trainer.workloads.synthetic import SyntheticBags, stream

TINY = {
    "apiVersion": "pipejob.dev/v1alpha1",
    "kind": "HybridJob",
    "metadata": {"name": "tiny-hybrid"},
    "spec": {
        "trainers": 2,
        "embedding": {"numEmbeddings": 64, "dim": 8, "mode": "sum"},
        "dense": {"outFeatures": 4},
        "steps": 40, "batchSize": 8, "bagSize": 4,
        "datasetSize": 101,  # odd: epochs end inside a step's batch (40 x 16 > 6 epochs)
        "optimizer": {"name": "sgd", "lr": 0.2, "momentum": 0.5},
        "logEvery": 10, "seed": 3, "rendezvousTimeoutSeconds": 60,
    },
}  # fmt: skip


@pytest.mark.timeout(200)
def test_two_trainers_train_with_identical_dense_weights_and_disjoint_data(tmp_path: Path) -> None:
    code, output, summary = run_to_end(TINY, tmp_path, timeout=170)
    assert code == 0, output
    assert summary is not None, output
    spec = TINY["spec"]

    # Progress on the master, then its summary.
    for step in (10, 20, 30, 40):
        assert re.search(rf"^master\s*\| step {step}/40 +loss [\d.]+ +[\d,]+ samples/s$",
                         output, re.M), output  # fmt: skip
    assert re.search(r"^master\s*\| done: 40 steps x 8 bags on 2 trainer", output, re.M), output
    assert summary["trainers"] == 2 and summary["steps"] == 40
    assert summary["samplesPerSecond"] > 0
    # Every process's peak memory: torch alone keeps over 50 MB resident; none nears 20 GB.
    memory = summary["memory"]
    assert list(memory) == ["master", "ps", "trainer0", "trainer1"], memory
    assert all(50e6 < m["rssPeakBytes"] < 20e9 for m in memory.values()), memory
    assert re.search(r"^master\s*\| peak memory: master \d+ MB, ps \d+ MB, trainer0 \d+ MB,"
                     r" trainer1 \d+ MB$", output, re.M), output  # fmt: skip

    # DDP kept the dense replicas identical, and they did train.
    assert summary["denseMaxAbsDiff"] == 0.0
    trainers = summary["perTrainer"]
    assert list(trainers) == ["trainer0", "trainer1"]
    assert all(t["denseChangeNorm"] > 0 for t in trainers.values())

    # Distributed autograd and the optimizer reached the parameter server's table.
    assert summary["embeddingChangeNorm"] > 0

    # The task is learnable: the loss falls.
    assert summary["finalLoss"] < 0.7 * summary["firstLoss"], summary

    # Each trainer read its half of every step's batch, and no sample twice in an epoch.
    assert summary["samplesRepeated"] == 0
    assert [t["share"] for t in trainers.values()] == [spec["batchSize"]] * 2


REFERENCE = TINY | {"spec": TINY["spec"] | {
    "trainers": 1, "steps": 12, "embedding": {"numEmbeddings": 64, "dim": 8, "mode": "max"},
    "optimizer": {"name": "adam", "lr": 0.05, "weightDecay": 0.01}}}  # fmt: skip


def reference_weights(spec: HybridSpec) -> dict[str, torch.Tensor]:
    """The same training in one process with plain autograd: the table's and the dense
    layer's optimizers stepped after each backward, as DistributedOptimizer would."""
    emb, seed = spec.embedding, spec.seed
    table = Table(spec, trainers=[]).module  # the ps's seeded table; trained here, not there
    torch.manual_seed(seed)
    linear = nn.Linear(emb.dim, spec.dense.out_features)
    optimizer_class, kwargs = optimizer_args(spec.optimizer)
    optimizers = [optimizer_class(m.parameters(), **kwargs) for m in (table, linear)]
    dataset = SyntheticBags(size=spec.dataset_size, num_embeddings=emb.num_embeddings,
                            classes=spec.dense.out_features, bag_size=spec.bag_size,
                            seed=seed)  # fmt: skip
    batches = stream(dataset, spec.batch_size, (0, 1), seed)
    for _ in range(spec.steps):
        batch = next(batches)
        bags = table(torch.tensor(batch.ids), torch.tensor(batch.offsets))
        F.cross_entropy(linear(bags), torch.tensor(batch.labels)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return {"table": table.weight.detach(), **{k: v.detach() for k, v in
                                               linear.state_dict().items()}}  # fmt: skip


@pytest.mark.timeout(200)
def test_the_table_stepped_in_the_backward_matches_a_single_process_reference(
    tmp_path: Path,
) -> None:
    """The ps steps the table as the lookup's gradient arrives and the trainer steps the
    dense layer on the context's gradients: with one trainer (a deterministic world) that
    must train exactly like plain autograd with one optimizer step after each backward."""
    spec = specs.parse(REFERENCE).settings  # defaulted
    steps = spec.steps
    manifest = REFERENCE | {"spec": REFERENCE["spec"] | {
        "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": steps}}}  # fmt: skip
    code, output, summary = run_to_end(manifest, tmp_path, timeout=170)
    assert code == 0, output
    found = checkpoint.latest(tmp_path / "ckpt")
    assert found is not None and found.step == steps, output
    got = {"table": found.load("ps.pt")["model"]["weight"], **found.load("dense.pt")["model"]}
    expected = reference_weights(spec)
    assert sorted(got) == sorted(expected)
    for name, weight in expected.items():
        torch.testing.assert_close(got[name], weight, rtol=1e-5, atol=1e-6, msg=name)
