"""A user's dataset that records which process reads each of its samples: every read
appends "<split> <index>" to a file named after the reading process's RPC name (a DataLoader
worker has its parent's), in `folder`. What `test_first_stage_reads.py` brings with
`import:` to see where a PipelineJob's data is read."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset


class Recorded(Dataset):
    """Sample i: a seeded 3x32x32 image of class i % classes."""

    def __init__(self, split: str, size: int, classes: int, folder: str):
        self.split, self.size, self.classes, self.folder = split, size, classes, Path(folder)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        reader = os.environ.get("PIPEJOB_RPC_NAME", "outside")
        with open(self.folder / f"{reader}.reads", "a") as f:
            f.write(f"{self.split} {i}\n")
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 32, 32, generator=g), i % self.classes


def recorded(split: str, folder: str, size: int = 40, classes: int = 10) -> Recorded:
    return Recorded(split, size if split == "train" else size // 2, classes, folder)
