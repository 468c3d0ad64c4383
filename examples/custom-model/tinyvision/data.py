"""The data: a factory returning a map-style torch Dataset of (image, label) pairs, called
with split="train" or split="val" (None there: no held-out set). These are drawn shapes, so
the example needs no download: a square, a disc, a cross or a bar, placed and sized at
random, with noise. Sample i is a function of (split, i) alone."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

SHAPES = ("square", "disc", "cross", "bar")


class Shapes(Dataset):
    def __init__(self, size: int, seed: int, pixels: int = 32):
        self.size, self.seed, self.pixels = size, seed, pixels

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(len(SHAPES), (), generator=g))
        n = self.pixels
        r = int(torch.randint(n // 5, n // 3, (), generator=g))
        cy, cx = (int(v) for v in torch.randint(r, n - r, (2,), generator=g))
        y, x = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        dy, dx = (y - cy).abs(), (x - cx).abs()
        mask = {
            "square": (dy <= r) & (dx <= r),
            "disc": dy**2 + dx**2 <= r**2,
            "cross": ((dy <= r // 3) & (dx <= r)) | ((dx <= r // 3) & (dy <= r)),
            "bar": (dy <= r // 3) & (dx <= r),
        }[SHAPES[label]]
        image = mask.float() + 0.2 * torch.randn(n, n, generator=g)
        return image.unsqueeze(0), label


def shapes(split: str, size: int = 2000) -> Dataset:
    """`size` training images, or a fifth as many held-out ones drawn apart."""
    return Shapes(size, seed=1) if split == "train" else Shapes(size // 5, seed=2)
