"""The HybridJob's synthetic bags and clicks, and the one order the trainers read them in."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

from pipejob.trainer.workloads.samples import OneFeature, order, stream
from pipejob.trainer.workloads.synthetic import SyntheticBags, SyntheticClicks

pytestmark = pytest.mark.timeout(60)

SHAPES = [(10, 1), (10, 2), (10, 3), (11, 4), (100, 7), (4096, 2), (1000, 16), (5, 5)]


def take(
    data: SyntheticBags, batch: int, share: tuple[int, int], steps: int, start: int = 0
) -> list[list[tuple[int, int]]]:
    """`steps` batches of one trainer's share, as (epoch, sample) pairs."""
    return [
        list(zip(b.epochs, b.sample_ids, strict=True))
        for b in itertools.islice(
            stream(OneFeature(data, "ids"), batch, share, 3, ["ids"], False, start), steps
        )
    ]


@pytest.mark.parametrize("size,parts", SHAPES)
def test_the_trainers_share_each_batch_of_one_stream_that_reads_every_sample_once_an_epoch(
    size: int, parts: int
) -> None:
    data = SyntheticBags(size=size, num_embeddings=30, classes=3, bag_size=4, seed=1)
    batch, steps = 3 * parts + 1, 2 * size // parts + 3  # shares of 3 and 4; over two epochs
    whole = take(data, batch, (0, 1), steps)
    shares = [take(data, batch, (k, parts), steps) for k in range(parts)]
    for step in range(steps):  # the trainers' shares, in rank order, are the whole batch
        assert [p for k in range(parts) for p in shares[k][step]] == whole[step]
    sizes = {len(shares[k][0]) for k in range(parts)}
    assert max(sizes) - min(sizes) <= 1 and sum(len(s[0]) for s in shares) == batch
    flat = [p for b in whole for p in b]
    for epoch in range(flat[-1][0]):  # every whole epoch: each sample once
        assert sorted(i for e, i in flat if e == epoch) == list(range(size))
    # A position (samples consumed) goes on at any trainer count.
    assert take(data, batch, (0, 1), 2, start=2 * batch) == whole[2:4]


def test_the_order_is_deterministic_and_depends_on_the_seed_and_the_epoch() -> None:
    assert order(1000, 7, 0) == order(1000, 7, 0)
    assert order(1000, 7, 0) != order(1000, 8, 0)
    assert order(1000, 7, 0) != order(1000, 7, 1)
    assert sorted(order(1000, 7, 0)) == list(range(1000)) != order(1000, 7, 0)


def test_a_share_must_exist() -> None:
    data = SyntheticBags(size=10, num_embeddings=30, classes=3, bag_size=4, seed=1)
    with pytest.raises(ValueError, match="cannot read share 2 of 2"):
        next(stream(OneFeature(data, "ids"), 8, (2, 2), 0, ["ids"], False))


@pytest.mark.parametrize("num_embeddings,classes", [(1000, 8), (100, 7), (3, 8), (1, 2)])
def test_every_bag_draws_from_its_label_s_rows(num_embeddings: int, classes: int) -> None:
    data = SyntheticBags(
        size=500, num_embeddings=num_embeddings, classes=classes, bag_size=6, seed=1
    )
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


def test_samples_and_their_order_are_the_same_in_another_process() -> None:
    """Every trainer computes them itself: string hashing must not make them differ."""
    code = (
        "from pipejob.trainer.workloads.samples import order\n"
        "from pipejob.trainer.workloads.synthetic import SyntheticBags\n"
        "d = SyntheticBags(size=50, num_embeddings=30, classes=3, bag_size=4, seed=9)\n"
        "print([d.sample(i) for i in range(50)], order(50, 9, 2))\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env=os.environ | {"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        for seed in ("1", "2")
    }
    data = SyntheticBags(size=50, num_embeddings=30, classes=3, bag_size=4, seed=9)
    assert outputs == {f"{[data.sample(i) for i in range(50)]} {order(50, 9, 2)}\n"}


def test_batches_are_in_embedding_bag_layout() -> None:
    data = SyntheticBags(size=40, num_embeddings=20, classes=4, bag_size=5, seed=2)
    bags = OneFeature(data, "ids")
    drawn = list(itertools.islice(stream(bags, 10, (1, 2), 2, ["ids"], False), 6))
    for b in drawn:
        offsets, ids = b.offsets("ids").tolist(), b.ids["ids"].tolist()
        assert len(b.sample_ids) == len(offsets) == len(b.labels) == len(b.epochs) == 5
        assert b.dense.shape == (5, 0)
        bounds = [*offsets, len(ids)]
        for j, i in enumerate(b.sample_ids):
            assert (ids[bounds[j] : bounds[j + 1]], b.labels[j].item()) == data.sample(i)
    # A resumed run's batches from step k on are the whole run's.
    again = list(itertools.islice(stream(bags, 10, (1, 2), 2, ["ids"], False, 40), 2))
    assert [b.sample_ids for b in again] == [b.sample_ids for b in drawn[4:6]]


def test_clicks_are_learnable_and_keep_to_their_tables_rows() -> None:
    data = SyntheticClicks(
        size=400, features=(("a", 7), ("b", 1000)), dense_features=3, bag_size=3, seed=4
    )
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
