"""TensorBoard event files of the master's figures (spec.logging.tensorboard).

Written with tensorboardX: it writes the same event files as torch.utils.tensorboard, which
needs the whole tensorboard package (its web server, grpcio, ...) in the trainer image;
tensorboardX needs only protobuf (docs/user-guide.md has the sizes). A resumed run purges
what a failed run wrote after the checkpoint it resumes from, so every step has one value."""

from __future__ import annotations

import math
from typing import Any

# Scalars' tags: TensorBoard groups them by the part before the slash.
TAGS = {
    "loss": "train/loss",
    "lr": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "samples_per_second": "train/samples_per_second",
    "bubble": "train/bubble",
    "eval_loss": "eval/loss",
    "eval_accuracy": "eval/accuracy",
    "eval_perplexity": "eval/perplexity",
    "eval_auc": "eval/auc",
}


class Events:
    """The run's event file, or nothing when the spec asks for none."""

    def __init__(self, directory: str | None, first: int = 0):
        self._writer: Any = None
        if directory is None:
            return
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise RuntimeError(
                f"spec.logging.tensorboard needs tensorboardX in the trainer image: {e}"
            ) from None
        # purge_step: the steps after `first` that an earlier, failed run wrote go away.
        self._writer = SummaryWriter(
            directory, purge_step=first + 1 if first else None, flush_secs=10
        )

    def scalars(self, step: int, **figures: float | None) -> None:
        """The figures of `step` (1-based) under their TAGS; None and non-finite ones left out."""
        if self._writer is None:
            return
        for name, value in figures.items():
            if value is not None and math.isfinite(value):
                self._writer.add_scalar(TAGS[name], value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
