"""A user's datasets that record which process reads each of their samples: every read
appends "<split> <index>" to a file named after the reading process's RPC name (a DataLoader
worker has its parent's), in `folder`. What `test_first_stage_reads.py` brings with
`import:` to see where a PipelineJob's data is read, and `test_elastic.py` to see that a world
resumed at another shape reads on exactly where the last stopped. With them, models that
compute in float64 whatever their input (no BatchNorm, no dropout): the same sums at any cut,
micro-batch count, replica or trainer count, up to float64's rounding."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset


def _record(folder: Path, split: str, i: int) -> None:
    reader = os.environ.get("PIPEJOB_RPC_NAME", "outside")
    with open(folder / f"{reader}.reads", "a") as f:
        f.write(f"{split} {i}\n")


class Recorded(Dataset):
    """Sample i: a seeded 3x32x32 image of class i % classes."""

    def __init__(self, split: str, size: int, classes: int, folder: str):
        self.split, self.size, self.classes, self.folder = split, size, classes, Path(folder)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        _record(self.folder, self.split, i)
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 32, 32, generator=g), i % self.classes


def recorded(split: str, folder: str, size: int = 40, classes: int = 10) -> Recorded:
    return Recorded(split, size if split == "train" else size // 2, classes, folder)


class RecordedBags(Dataset):
    """Bag i: the one id i (every bag its own row of the table, so no two bags of an epoch
    touch the same row, and trainers' table steps in any order give the same table), of
    class i % classes."""

    def __init__(self, split: str, size: int, classes: int, folder: str):
        self.split, self.size, self.classes, self.folder = split, size, classes, Path(folder)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[list[int], int]:
        _record(self.folder, self.split, i)
        return [i], i % self.classes


def bags(split: str, folder: str, size: int = 48, classes: int = 4) -> RecordedBags | None:
    return RecordedBags(split, size, classes, folder) if split == "train" else None


class Float64(nn.Module):
    """Its input in float64, so what follows computes in float64."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double()


def mlp(classes: int = 10, width: int = 16) -> nn.Module:
    """An image classifier in float64 with places to cut it in 2 or 3 stages."""
    return nn.Sequential(
        Float64(),
        nn.Flatten(),
        nn.Linear(3 * 32 * 32, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, classes),
    ).double()


def dense(dim: int, classes: int) -> nn.Module:
    """A HybridJob's dense model in float64 on the bags' embeddings."""
    return nn.Sequential(Float64(), nn.Linear(dim, classes)).double()
