"""Synthetic data, seeded and learnable: images or tokens for a PipelineJob, bags for a HybridJob.

Bags are pure Python so every piece is unit-testable and identical in every process: a sample
is a function of (seed, index) alone, and the order the trainers read them in (`stream`: a
seeded permutation of the samples per epoch, each step's batch split among the trainers) is a
function of (size, seed) alone, the same at any trainer count.

The task is learnable on purpose, so a falling loss shows training works: every bag draws all its
ids from one class's rows of the table (row r belongs to class r mod classes), and its label is
that class."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SyntheticBags:
    size: int  # samples in the dataset
    num_embeddings: int  # rows of the table the ids index
    classes: int  # labels the dense layer predicts
    bag_size: int  # most ids in one bag
    seed: int

    def __post_init__(self) -> None:
        for name in ("size", "num_embeddings", "classes", "bag_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def used_classes(self) -> int:
        """Classes that own at least one row (all of them unless the table is tiny)."""
        return min(self.classes, self.num_embeddings)

    def sample(self, i: int) -> tuple[list[int], int]:
        """Sample i: (the bag's embedding ids, its label)."""
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} outside a dataset of {self.size}")
        # A str seed is hashed with sha512: the same in every process and Python run.
        rng = random.Random(f"pipejob-bag:{self.seed}:{i}")
        k = self.used_classes
        label = rng.randrange(k)
        rows_of_label = (self.num_embeddings - label + k - 1) // k  # rows r with r % k == label
        length = rng.randint(1, self.bag_size)
        ids = [label + k * rng.randrange(rows_of_label) for _ in range(length)]
        return ids, label


def order(size: int, seed: int, epoch: int) -> list[int]:
    """Epoch `epoch`'s order of the samples 0..size-1: a function of (size, seed, epoch)."""
    indices = list(range(size))
    random.Random(f"pipejob-order:{seed}:{epoch}").shuffle(indices)
    return indices


@dataclass(frozen=True)
class Batch:
    sample_ids: list[int]
    ids: list[int]  # the bags' embedding ids, concatenated
    offsets: list[int]  # where each bag starts in `ids` (EmbeddingBag's layout)
    labels: list[int]
    epochs: list[int] = field(default_factory=list)  # the pass over the data of each sample


def gather(data: SyntheticBags, chosen: list[int], epochs: list[int] | None = None) -> Batch:
    """Samples `chosen` of `data` (any source with `sample(i)`) as one batch."""
    ids: list[int] = []
    offsets: list[int] = []
    labels: list[int] = []
    for i in chosen:
        bag, label = data.sample(i)
        offsets.append(len(ids))
        ids.extend(bag)
        labels.append(label)
    return Batch(chosen, ids, offsets, labels, epochs or [])


def share_of(batch: int, k: int, parts: int) -> range:
    """Which samples of a batch of `batch` part k of `parts` takes (a replica's, a
    trainer's): equal parts where they divide, else sizes that differ by one."""
    return range(k * batch // parts, (k + 1) * batch // parts)


def stream(data: SyntheticBags, batch: int, share: tuple[int, int], seed: int,
           start: int = 0) -> Iterator[Batch]:  # fmt: skip
    """Trainer k of T's share, `share` (k, T), of every step's batch, forever: the steps read
    the stream of epoch 0's order of the samples, then epoch 1's, ..., `batch` samples at a
    time from sample `start` of the stream on, and trainer k takes samples k*batch//T to
    (k+1)*batch//T - 1 of each (equal shares where T divides the batch). A step's batch is
    the same at any T: a position (samples consumed) resumes at any trainer count, and no
    sample is read twice in one epoch."""
    if data.size < 1 or not 0 <= share[0] < share[1]:
        raise ValueError(f"cannot read share {share[0]} of {share[1]} of {data.size} samples")
    rows = share_of(batch, *share)
    orders: dict[int, list[int]] = {}  # the epochs the last batch read
    for position in itertools.count(start, batch):
        places = [divmod(position + r, data.size) for r in rows]
        orders = {e: orders.get(e) or order(data.size, seed, e) for e, _ in places}
        yield gather(data, [orders[e][i] for e, i in places], [e for e, _ in places])


class SyntheticImages:
    """Seeded random images whose class shifts their colour: deterministic, and learnable.
    `generator` is the whole state a checkpoint keeps."""

    def __init__(self, seed: int, batch_size: int, image_size: int, classes: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.size = (batch_size, 3, image_size, image_size)
        self.colours = torch.randn(classes, 3, 1, 1, generator=self.generator)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(len(self.colours), self.size[:1], generator=self.generator)
        images = torch.randn(self.size, generator=self.generator) + self.colours[labels]
        return images, labels


def held_out_images(seed: int, batch_size: int, image_size: int, classes: int,
                    offset: int = 1_000_003) -> SyntheticImages:  # fmt: skip
    """The held-out stream of `SyntheticImages(seed, ...)`: the same classes' colours (the same
    task), other images (its generator reseeded with seed + offset after the colours)."""
    images = SyntheticImages(seed, batch_size, image_size, classes)
    images.generator.manual_seed(seed + offset)
    return images


class SyntheticTokens:
    """Seeded token windows that follow one rule, t[i+1] = (a*t[i] + b) % vocab, from a random
    start: deterministic, and learnable (a language model that learns the rule predicts every
    label), so a falling loss shows training works. The rule is a function of `rule_seed`
    alone (the held-out stream shares it); `generator` is the whole state a checkpoint keeps.
    A batch is (inputs, labels), int64 (batch, seq_len) each, labels the inputs shifted by one."""

    def __init__(self, seed: int, batch_size: int, seq_len: int, vocab: int,
                 rule_seed: int | None = None):  # fmt: skip
        if vocab < 2 or seq_len < 1 or batch_size < 1:
            raise ValueError(f"need vocab >= 2, seq_len >= 1, batch_size >= 1; got {vocab},"
                             f" {seq_len}, {batch_size}")  # fmt: skip
        rule = random.Random(f"pipejob-tokens:{seed if rule_seed is None else rule_seed}")
        # a coprime with vocab: t -> a*t + b is a permutation, so windows do not collapse
        # into a short cycle and every token occurs.
        self.a = next(a for a in iter(lambda: rule.randrange(1, vocab), None)
                      if math.gcd(a, vocab) == 1 and (a > 1 or vocab == 2))  # fmt: skip
        self.b = rule.randrange(vocab)
        self.vocab, self.seq_len, self.batch_size = vocab, seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.successor = (self.a * torch.arange(vocab) + self.b) % vocab

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        windows = torch.empty(self.batch_size, self.seq_len + 1, dtype=torch.int64)
        windows[:, 0] = torch.randint(self.vocab, (self.batch_size,), generator=self.generator)
        for i in range(self.seq_len):
            windows[:, i + 1] = self.successor[windows[:, i]]
        return windows[:, :-1], windows[:, 1:]
