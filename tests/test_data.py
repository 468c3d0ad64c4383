"""The HybridJob's synthetic bags and clicks, and their partition across trainers."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

from pipejob.trainer.workloads.samples import OneFeature, batches, partitions
from pipejob.trainer.workloads.synthetic import SyntheticBags, SyntheticClicks

pytestmark = pytest.mark.timeout(60)

SHAPES = [(10, 1), (10, 2), (10, 3), (11, 4), (100, 7), (4096, 2), (1000, 16), (5, 5)]


@pytest.mark.parametrize("size,parts", SHAPES)
def test_partitions_are_disjoint_covering_and_balanced(size: int, parts: int) -> None:
    split = partitions(size, parts, seed=3)
    assert len(split) == parts
    flat = [i for part in split for i in part]
    assert len(flat) == len(set(flat)), "a sample is in two partitions"
    assert sorted(flat) == list(range(size)), "the partitions do not cover the dataset"
    sizes = [len(part) for part in split]
    assert max(sizes) - min(sizes) <= 1
    assert min(sizes) >= 1


def test_partitions_are_deterministic_and_depend_on_the_seed() -> None:
    assert partitions(1000, 4, seed=7) == partitions(1000, 4, seed=7)
    assert partitions(1000, 4, seed=7) != partitions(1000, 4, seed=8)
    # Shuffled, not contiguous ranges: each part samples the whole dataset.
    assert partitions(1000, 4, seed=7)[0] != list(range(250))


@pytest.mark.parametrize("size,parts", [(3, 4), (0, 1), (10, 0)])
def test_partitions_refuse_impossible_splits(size: int, parts: int) -> None:
    with pytest.raises(ValueError, match="cannot split"):
        partitions(size, parts, seed=0)


@pytest.mark.parametrize("num_embeddings,classes", [(1000, 8), (100, 7), (3, 8), (1, 2)])
def test_every_bag_draws_from_its_label_s_rows(num_embeddings: int, classes: int) -> None:
    data = SyntheticBags(size=500, num_embeddings=num_embeddings, classes=classes, bag_size=6,
                         seed=1)  # fmt: skip
    labels = set()
    for i in range(data.size):
        ids, label = data.sample(i)
        labels.add(label)
        assert 0 <= label < min(classes, num_embeddings)
        assert 1 <= len(ids) <= 6
        assert all(0 <= r < num_embeddings and r % data.used_classes == label for r in ids)
    assert labels == set(range(data.used_classes)), "some class never occurs"


def test_samples_are_a_function_of_seed_and_index() -> None:
    data = SyntheticBags(size=100, num_embeddings=50, classes=4, bag_size=8, seed=5)
    assert [data.sample(i) for i in range(100)] == [data.sample(i) for i in range(100)]
    other = SyntheticBags(size=100, num_embeddings=50, classes=4, bag_size=8, seed=6)
    assert [data.sample(i) for i in range(100)] != [other.sample(i) for i in range(100)]
    with pytest.raises(IndexError):
        data.sample(100)


def test_samples_and_partitions_are_the_same_in_another_process() -> None:
    """Every trainer computes them itself: string hashing must not make them differ."""
    code = (
        "from pipejob.trainer.workloads.samples import partitions\n"
        "from pipejob.trainer.workloads.synthetic import SyntheticBags\n"
        "d = SyntheticBags(size=50, num_embeddings=30, classes=3, bag_size=4, seed=9)\n"
        "print([d.sample(i) for i in range(50)], partitions(50, 3, 9))\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], env=os.environ | {"PYTHONHASHSEED": seed},
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout
        for seed in ("1", "2")
    }  # fmt: skip
    data = SyntheticBags(size=50, num_embeddings=30, classes=3, bag_size=4, seed=9)
    assert outputs == {f"{[data.sample(i) for i in range(50)]} {partitions(50, 3, 9)}\n"}


def test_batches_cycle_through_the_partition_in_embedding_bag_layout() -> None:
    data = SyntheticBags(size=40, num_embeddings=20, classes=4, bag_size=5, seed=2)
    part = partitions(40, 3, seed=2)[1]  # 13 samples: batches of 5 wrap around
    drawn = list(itertools.islice(batches(OneFeature(data, "ids"), part, 5, ["ids"], False), 6))
    ids_in_order = [i for b in drawn for i in b.sample_ids]
    assert ids_in_order == (part * 3)[:30]
    for b in drawn:
        offsets, ids = b.offsets("ids").tolist(), b.ids["ids"].tolist()
        assert len(b.sample_ids) == len(offsets) == len(b.labels) == 5
        assert b.dense.shape == (5, 0)
        bounds = [*offsets, len(ids)]
        for j, i in enumerate(b.sample_ids):
            assert (ids[bounds[j] : bounds[j + 1]], b.labels[j].item()) == data.sample(i)
    # A resumed run's batches from step k on are the whole run's.
    again = list(itertools.islice(batches(OneFeature(data, "ids"), part, 5, ["ids"], False, 4), 2))
    assert [b.sample_ids for b in again] == [b.sample_ids for b in drawn[4:6]]


def test_clicks_are_learnable_and_keep_to_their_tables_rows() -> None:
    data = SyntheticClicks(size=400, features=(("a", 7), ("b", 1000)), dense_features=3,
                           bag_size=3, seed=4)  # fmt: skip
    own = total = 0
    for i in range(data.size):
        dense, sparse, label = data.sample(i)
        assert label in (0, 1) and len(dense) == 3 and sorted(sparse) == ["a", "b"]
        assert all(0 <= r < 7 for r in sparse["a"]) and all(0 <= r < 1000 for r in sparse["b"])
        own += sum(r % 2 == label for r in sparse["a"] + sparse["b"])
        total += len(sparse["a"]) + len(sparse["b"])
    assert own / total > 0.8  # four in five ids from the label's rows, and half the others
    assert data.sample(5) == data.sample(5) != data.sample(6)


def test_synthetic_bags_refuse_empty_shapes() -> None:
    with pytest.raises(ValueError, match="bag_size"):
        SyntheticBags(size=10, num_embeddings=10, classes=2, bag_size=0, seed=0)
