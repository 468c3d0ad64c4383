"""The default loss and the held-out figures: loss, and accuracy for classification or
perplexity for a language model."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

CLASSIFICATION, LANGUAGE = "classification", "language"


def cross_entropy(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean over samples, or over tokens when every position has a label (outputs
    (batch, length, vocab), labels (batch, length))."""
    if outputs.dim() > 2:
        return F.cross_entropy(outputs.flatten(0, -2), labels.flatten())
    return F.cross_entropy(outputs, labels)


class Tally:
    """Held-out figures summed over batches; every loss is taken as a mean over its batch's
    samples (tokens, for a language model), so sums weight it by their count."""

    def __init__(self, task: str):
        self.task = task
        self.loss = 0.0
        self.count = 0  # samples, or tokens
        self.correct = 0
        self.samples = 0

    def add(self, outputs: Any, labels: torch.Tensor, loss: Any) -> None:
        n = labels.numel() if self.task == LANGUAGE else len(labels)
        self.loss += float(loss(outputs, labels)) * n
        self.count += n
        self.samples += len(labels)
        if isinstance(outputs, torch.Tensor) and outputs.dim() == labels.dim() + 1:
            self.correct += int((outputs.argmax(-1) == labels).sum())

    def result(self) -> dict[str, Any]:
        """loss, accuracy (classification) or perplexity (language), samples."""
        mean = self.loss / max(self.count, 1)
        figures: dict[str, Any] = {"loss": round(mean, 6), "samples": self.samples}
        if self.task == LANGUAGE:
            figures["perplexity"] = round(math.exp(min(mean, 700.0)), 4)
        else:
            figures["accuracy"] = round(self.correct / max(self.count, 1), 6)
        return figures
