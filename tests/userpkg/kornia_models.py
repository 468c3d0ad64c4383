"""A small classifier that blurs its features with kornia's gaussian_blur2d in its forward
(kornia checks that its input is a tensor: issue 56, class 5)."""

from __future__ import annotations

import kornia
import torch
from torch import nn


class Blurred(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = kornia.filters.gaussian_blur2d(self.stem(x), (3, 3), (1.5, 1.5))
        return self.head(self.body(x))


def blurred(classes: int = 10) -> nn.Module:
    return Blurred(classes)
