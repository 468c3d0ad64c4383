"""HybridJob end to end: `pipejob run` starts master, ps and two DDP trainers on loopback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobrun import run_to_end
from pipejob.trainer.data import partitions

TINY = {
    "apiVersion": "pipejob.dev/v1alpha1",
    "kind": "HybridJob",
    "metadata": {"name": "tiny-hybrid"},
    "spec": {
        "trainers": 2,
        "embedding": {"numEmbeddings": 64, "dim": 8, "mode": "sum"},
        "dense": {"outFeatures": 4},
        "steps": 40, "batchSize": 8, "bagSize": 4,
        "datasetSize": 101,  # odd: partitions of 51 and 50, each read whole (40 x 8 > 51)
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
    assert summary["samples_per_second"] > 0

    # DDP kept the dense replicas identical, and they did train.
    assert summary["dense_max_abs_diff"] == 0.0
    trainers = summary["per_trainer"]
    assert list(trainers) == ["trainer0", "trainer1"]
    assert all(t["dense_change_norm"] > 0 for t in trainers.values())

    # Distributed autograd and the optimizer reached the parameter server's table.
    assert summary["embedding_change_norm"] > 0

    # The task is learnable: the loss falls.
    assert summary["loss_final"] < 0.7 * summary["loss_first"], summary

    # Each trainer read exactly its own partition, and no sample was read twice.
    assert summary["partition_overlap"] == 0
    expected = partitions(spec["datasetSize"], 2, spec["seed"])
    assert not set(expected[0]) & set(expected[1])
    assert sorted(expected[0] + expected[1]) == list(range(spec["datasetSize"]))
    for name, part in zip(["trainer0", "trainer1"], expected, strict=True):
        assert trainers[name]["partition_size"] == len(part)
        assert trainers[name]["samples_read"] == len(part)
