"""The built-in cross-entropy with spec.loss.crossEntropy's options (label smoothing, the
ignored label), as a value that crosses RPC to the last stage and tells the held-out metrics
which label it leaves out (`ignore_index`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipejob.core.workload import CrossEntropy
from pipejob.trainer.workloads import metrics


@dataclass(frozen=True)
class LabelLoss:
    """metrics.cross_entropy with F.cross_entropy's label_smoothing and ignore_index."""

    label_smoothing: float = 0.0
    # The label the loss does not count: what accuracy and perplexity should skip too.
    ignore_index: int = -100

    @classmethod
    def of(cls, options: CrossEntropy) -> LabelLoss:
        return cls(options.label_smoothing, options.ignore_index)

    def __call__(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        return metrics.cross_entropy(
            outputs,
            labels,
            label_smoothing=self.label_smoothing,
            ignore_index=self.ignore_index,
        )
