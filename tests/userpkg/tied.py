"""A plain torch language model whose output layer reuses the input embedding's weight under
the embedding's own name (`F.linear(h, self.embed.weight)`: the first and the last stage both
hold `embed.weight`), and a layer its forward never uses (the state no stage holds)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from userpkg.brought import VOCAB


class TiedLM(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4))
        )
        self.norm = nn.LayerNorm(width)
        self.spare = nn.Linear(width, 2)  # never called

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(self.blocks(self.embed(ids))), self.embed.weight)


def tied_lm(width: int = 32) -> nn.Module:
    return TiedLM(width)
