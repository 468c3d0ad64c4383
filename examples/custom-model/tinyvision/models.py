"""The model: a factory returning an nn.Module. pipejob cuts it into stages at module names
(here the items of the Sequential) and hands it back, trained, under these same names."""

from __future__ import annotations

from torch import nn


def cnn(classes: int = 4, width: int = 16) -> nn.Module:
    """A small classifier of 1x32x32 images."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 8 * 8, 64),
        nn.ReLU(),
        nn.Linear(64, classes),
    )
