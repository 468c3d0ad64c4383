"""A small stand-in for MONAI's DynUNet with deep supervision (issue 56), without MONAI: its
blocks are registered twice (input_block is also skip_layers.downsample, as DynUNet's skip
layers hold its blocks), and an inner skip layer writes its head's output into a Python list
made with the model, which the forward reads after the skip layers have run; `vectors` is a
data source for it (4 features, 4 classes: its output's 2 + the deep head's 2)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

WIDTH = 8


class Skip(nn.Module):
    """As DynUNetSkipLayer: down, the next layer, up; with a head, its output written into
    `heads` (the list the model's forward reads)."""

    def __init__(
        self,
        downsample: nn.Module,
        next_layer: nn.Module,
        upsample: nn.Module,
        head: nn.Module | None = None,
        heads: list[torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.downsample, self.next_layer, self.upsample = downsample, next_layer, upsample
        self.head, self.heads = head, heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.downsample(x)
        up = self.upsample(torch.tanh(self.next_layer(down)) + down)
        if self.head is not None and self.heads is not None:
            self.heads[0] = self.head(up)
        return up


class SkipHeads(nn.Module):
    """Blocks in the model's own attributes, the skip layers holding the same blocks again."""

    def __init__(self) -> None:
        super().__init__()
        self.input_block = nn.Linear(4, WIDTH)
        self.downsample = nn.Linear(WIDTH, WIDTH)
        self.bottleneck = nn.Linear(WIDTH, WIDTH)
        self.upsamples = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.deep_head = nn.Linear(WIDTH, 2)
        self.output_block = nn.Linear(WIDTH, 2)
        self.heads: list[torch.Tensor] = [torch.zeros(1, 2)]
        inner = Skip(
            self.downsample, self.bottleneck, self.upsamples[0], self.deep_head, self.heads
        )
        self.skip_layers = Skip(self.input_block, inner, self.upsamples[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.output_block(self.skip_layers(x))
        return torch.cat([out, self.heads[0]], dim=1)


def skip_heads() -> nn.Module:
    torch.manual_seed(0)
    return SkipHeads()


def vectors(split: str, size: int = 64) -> TensorDataset:
    """Seeded samples of 4 features, each labelled with one of 4 classes."""
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    return TensorDataset(torch.randn(size, 4, generator=g), torch.randint(4, (size,), generator=g))
