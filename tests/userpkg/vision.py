"""A user's image classifier and loss, as a user's package holds them: what a PipelineJob
names with `model: {import: userpkg.vision:small_cnn}` and `loss: {import: ...}`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def small_cnn(classes: int = 10, width: int = 16, dropout: float = 0.0) -> nn.Module:
    """Two conv blocks and two linear layers for 3x32x32 images; with `dropout`, a Dropout
    before the last layer."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 8 * 8, 64),
        nn.ReLU(),
        *([nn.Dropout(dropout)] if dropout else []),
        nn.Linear(64, classes),
    )


def smoothed(smoothing: float = 0.1):
    """Cross-entropy with label smoothing, as a factory returning the loss function."""

    def loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, labels, label_smoothing=smoothing)

    return loss


def broken() -> nn.Module:
    raise RuntimeError("the factory's own bug")


def two_layers() -> nn.Module:
    """A model with two places to cut: it cannot fill three stages."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
