"""A HybridJob user's recommendation code: clicks as a Dataset of (dense features, {feature:
ids}, label), and a dense module taking (dense features, {table name: pooled embeddings})."""

from __future__ import annotations

import torch
from torch import nn


class Clicks(torch.utils.data.Dataset):
    """Item i: two dense features, 1-3 ids of feature `user` and one of `item`, and a click
    that follows the user's first id's parity."""

    def __init__(self, count: int, seed: int, bad: int | None = None):
        generator = torch.Generator().manual_seed(seed)
        self.users = [
            torch.randint(0, 50, (int(n),), generator=generator)
            for n in torch.randint(1, 4, (count,), generator=generator)
        ]
        self.items = torch.randint(0, 20, (count,), generator=generator)
        self.dense = torch.randn(count, 2, generator=generator)
        self.bad = bad

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, list[int]], int]:
        if i == self.bad:
            return self.dense[i], {"user": [77]}, 1  # an id past the user table's 50 rows
        sparse = {"user": self.users[i], "item": [int(self.items[i])]}
        return self.dense[i], sparse, int(self.users[i][0]) % 2


def clicks(split: str, count: int, bad: int | None = None) -> Clicks:
    return Clicks(count, seed={"train": 1, "val": 2}[split], bad=bad)


class Tower(nn.Module):
    """The dense part: the dense features and every table's pooled embedding, concatenated,
    through an MLP to one logit."""

    def __init__(self, tables: list[str], dim: int, dense: int):
        super().__init__()
        self.tables = tables
        self.mlp = nn.Sequential(
            nn.Linear(dense + dim * len(tables), 16), nn.ReLU(), nn.Linear(16, 1)
        )

    def forward(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.mlp(torch.cat([dense, *(pooled[t] for t in self.tables)], dim=1))
