"""A HybridJob user's code: a dense module on the bags' embeddings, a bag Dataset, and a
learnable task written as .npz files in pipejob's one-line format."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def mlp(dim: int, hidden: int, classes: int) -> nn.Module:
    """The dense model: the bags' embeddings (batch, dim) to class scores (batch, classes)."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def bags(rows: int, classes: int, count: int, seed: int) -> tuple[np.ndarray, ...]:
    """A learnable task: a bag of 2-6 ids, most from its class's rows (r % classes == label),
    the rest anywhere. (ids, offsets, labels), EmbeddingBag's layout."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(classes, size=count)
    lengths = rng.integers(2, 7, size=count)
    ids = []
    for label, length in zip(labels, lengths, strict=True):
        own = label + classes * rng.integers(rows // classes, size=length)
        noise = rng.integers(rows, size=length)
        ids.append(np.where(rng.random(length) < 0.8, own, noise))
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.concatenate(ids), offsets, labels


def write(path: str, rows: int, classes: int, count: int, seed: int) -> None:
    ids, offsets, labels = bags(rows, classes, count, seed)
    np.savez(path, ids=ids, offsets=offsets, labels=labels)  # the documented one line


class Bags(torch.utils.data.Dataset):
    """The same task as a map-style Dataset: item i is (ids, label)."""

    def __init__(self, rows: int, classes: int, count: int, seed: int):
        ids, offsets, self.labels = bags(rows, classes, count, seed)
        self.bags = np.split(ids, offsets[1:])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self.bags[i]), int(self.labels[i])


def dataset(split: str, rows: int, classes: int, count: int) -> Bags | None:
    """spec.data.import: the train split, and a held-out one drawn with another seed."""
    return Bags(rows, classes, count, seed={"train": 1, "val": 2}[split])
