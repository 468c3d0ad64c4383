"""Synthetic data, seeded and learnable: images or tokens for a PipelineJob, bags or clicks
for a HybridJob; a sample is a function of (seed, index) alone, and a falling loss shows
training works. Why so: docs/architecture.md, "The data's order"."""

from __future__ import annotations

import functools
import math
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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


@dataclass(frozen=True)
class SyntheticClicks:
    """Clicks for spec.embeddings, seeded and learnable: a sample's label is a fair coin;
    each feature gets 1 to `bag_size` ids, four in five from the rows whose parity is the
    label (the rest from any row), and its dense features are normal draws around
    label - 0.5. A sample is a function of (seed, index) alone."""

    size: int
    features: tuple[tuple[str, int], ...]  # (feature, rows of the smallest table it feeds)
    dense_features: int
    bag_size: int
    seed: int

    def sample(self, i: int) -> tuple[list[float], dict[str, list[int]], int]:
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} outside a dataset of {self.size}")
        rng = random.Random(f"pipejob-click:{self.seed}:{i}")
        label = rng.randrange(2)
        sparse = {}
        for feature, rows in self.features:
            own = (rows - label + 1) // 2  # rows r with r % 2 == label
            sparse[feature] = [
                2 * rng.randrange(own) + label
                if own and rng.random() < 0.8
                else rng.randrange(rows)
                for _ in range(rng.randint(1, self.bag_size))
            ]
        dense = [rng.gauss(label - 0.5, 1.0) for _ in range(self.dense_features)]
        return dense, sparse, label


def share_of(batch: int, k: int, parts: int) -> range:
    """Which samples of a batch of `batch` part k of `parts` takes (a replica's, a
    trainer's): equal parts where they divide, else sizes that differ by one."""
    return range(k * batch // parts, (k + 1) * batch // parts)


class SyntheticImages:
    """Seeded random images whose class shifts their colour: deterministic, and learnable.
    `generator` is the whole state a checkpoint keeps: it draws each batch's labels and the
    seed of its first image; image i of the batch is drawn from seed + i alone, so a batch's
    images are drawn on several threads (one generator draws serially: a 224-px batch of 256
    took longer than a GPU's step), the same on any machine, and a replica draws only its
    own rows."""

    def __init__(self, seed: int, batch_size: int, image_size: int, classes: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.size = (batch_size, 3, image_size, image_size)
        self.colours = torch.randn(classes, 3, 1, 1, generator=self.generator)

    def batch(self, rows: range | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch, or its `rows` (a replica's share): the stream moves on a batch."""
        labels = torch.randint(len(self.colours), self.size[:1], generator=self.generator)
        first = int(torch.randint(2**62, (), generator=self.generator))
        rows = range(self.size[0]) if rows is None else rows
        images = torch.empty(len(rows), *self.size[1:])

        def draw(k: int) -> None:
            images[k].normal_(generator=torch.Generator().manual_seed(first + rows[k]))

        list(_drawing().map(draw, range(len(rows))))
        labels = labels[rows.start : rows.stop]
        return images.add_(self.colours[labels]), labels


@functools.cache
def _drawing() -> ThreadPoolExecutor:
    """The threads that draw images (torch's kernels release the GIL while they draw)."""
    return ThreadPoolExecutor(min(8, os.cpu_count() or 1), "pipejob-draw")


os.register_at_fork(after_in_child=_drawing.cache_clear)  # a forked child has no threads


def held_out_images(
    seed: int, batch_size: int, image_size: int, classes: int, offset: int = 1_000_003
) -> SyntheticImages:
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

    def __init__(
        self, seed: int, batch_size: int, seq_len: int, vocab: int, rule_seed: int | None = None
    ):
        if vocab < 2 or seq_len < 1 or batch_size < 1:
            raise ValueError(
                f"need vocab >= 2, seq_len >= 1, batch_size >= 1; got {vocab},"
                f" {seq_len}, {batch_size}"
            )
        rule = random.Random(f"pipejob-tokens:{seed if rule_seed is None else rule_seed}")
        # a coprime with vocab: t -> a*t + b is a permutation, so windows do not collapse
        # into a short cycle and every token occurs.
        self.a = next(
            a
            for a in iter(lambda: rule.randrange(1, vocab), None)
            if math.gcd(a, vocab) == 1 and (a > 1 or vocab == 2)
        )
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
