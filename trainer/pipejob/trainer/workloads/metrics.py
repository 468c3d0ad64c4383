"""The default loss and the held-out figures: loss, and accuracy for classification, or
per-token accuracy and perplexity for a language model, told by the shapes of labels and
logits (the output, or a dict's `logits`), whatever model made them. A figure that cannot be
computed is left out, never 0, and none is computed from outputs that are not finite
(runtime/nonfinite.py). What users see: docs/user-guide.md, "The loss, the evaluation and
the output"."""

from __future__ import annotations

import math
from typing import Any, NotRequired, TypedDict

import torch
import torch.nn.functional as F

from pipejob.trainer.runtime import nonfinite
from pipejob.trainer.workloads import batch_values

CLASSIFICATION, LANGUAGE = "classification", "language"
IGNORE_INDEX = -100  # cross-entropy's default ignore_index: a label the loss does not count


class HeldOutResult(TypedDict):
    """A pass over the held-out set (`Tally.result`): its mean loss and samples, accuracy
    where predictions could be compared, perplexity for a language model."""

    loss: float
    samples: int
    accuracy: NotRequired[float]
    perplexity: NotRequired[float]


class HeldOutEvaluation(HeldOutResult):
    """An evaluation after `step` as the summary, model.json and the log have it: the
    weights' figures and, with spec.ema, the average's under "ema"."""

    step: int
    ema: NotRequired[HeldOutResult]


def logits(outputs: Any) -> torch.Tensor | None:
    """The model's logits: the output itself, or a dict's (ModelOutput's) `logits`."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict) and isinstance(outputs.get("logits"), torch.Tensor):
        return outputs["logits"]
    return None


class NeedsLoss(TypeError):
    """The default loss cannot take the model's output (a tuple, None): the job must give
    spec.loss. The master's fit check refuses the job on it before any stage is built."""


def cross_entropy(outputs: Any, labels: torch.Tensor, **options: Any) -> torch.Tensor:
    """The mean over samples, or over tokens when every position has a label (outputs
    (batch, length, vocab), labels (batch, length)); of the logits (see `logits`). `options`:
    F.cross_entropy's (label_smoothing, ignore_index: spec.loss.crossEntropy)."""
    scores = logits(outputs)
    if scores is None:
        raise NeedsLoss(
            "the default loss (cross-entropy) needs logits: a tensor or a dict with 'logits',"
            f" not a {type(outputs).__name__}; give spec.loss: {{import: mypkg.losses:build}},"
            " a factory of a callable (outputs, labels) -> the batch's mean loss, which takes"
            " this output as the model returns it"
        )
    if scores.dim() > 2:
        return F.cross_entropy(scores.flatten(0, -2), labels.flatten(), **options)
    return F.cross_entropy(scores, labels, **options)


def task_of(outputs: Any, labels: torch.Tensor) -> str | None:
    """LANGUAGE, CLASSIFICATION or None (neither can be told), from the shapes."""
    scores = logits(outputs)
    if scores is None or scores.dim() != labels.dim() + 1:
        return None
    if scores.shape[:-1] != labels.shape or labels.is_floating_point():
        return None
    return LANGUAGE if labels.dim() >= 2 else CLASSIFICATION


class Tally:
    """Held-out figures summed over batches; every loss is taken as a mean over its batch's
    samples (tokens, for a language model), so sums weight it by their count. `task` is
    what the data says (a token file is language); the shapes of the first batch decide
    where they tell."""

    def __init__(self, task: str):
        self.task = task
        self.loss = 0.0
        self.count = 0  # samples, or tokens
        self.correct = 0
        self.scored = 0  # samples or tokens whose prediction could be compared
        self.samples = 0
        self._told: str | None = None

    def add(self, outputs: Any, labels: Any, loss: Any) -> None:
        told = task_of(outputs, labels) if isinstance(labels, torch.Tensor) else None
        if self._told is None and told is not None:
            self._told = self.task = told
        counted = _counted(labels)
        per_label = counted is not None and (self.task == LANGUAGE or counted.dim() == 1)
        n = int(counted.sum()) if per_label else batch_values.samples(labels)  # type: ignore[union-attr]
        if not n:  # every label ignored: no loss to weigh (cross-entropy's is NaN)
            self.samples += batch_values.samples(labels)
            return
        value = float(loss(outputs, labels))
        nonfinite.check_outputs(outputs, value, f"the held-out batch after {self.samples} samples")
        self.samples += batch_values.samples(labels)
        self.loss += value * n
        self.count += n
        if told is not None:
            scores = logits(outputs)
            assert scores is not None and counted is not None
            self.correct += int(((scores.argmax(-1) == labels) & counted).sum())
            self.scored += int(counted.sum())

    def result(self) -> HeldOutResult:
        """loss, accuracy where predictions could be compared, perplexity (language),
        samples."""
        mean = self.loss / max(self.count, 1)
        figures = HeldOutResult(loss=round(mean, 6), samples=self.samples)
        if self.scored:
            figures["accuracy"] = round(self.correct / self.scored, 6)
        if self.task == LANGUAGE:
            figures["perplexity"] = round(math.exp(min(mean, 700.0)), 4)
        return figures


def _counted(labels: Any) -> torch.Tensor | None:
    """Which labels the loss counts (those not `IGNORE_INDEX`), for integer labels; None
    for labels that are not class indices (floats, a dict)."""
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dim() == 0:
        return None
    return labels != IGNORE_INDEX


def describe(figures: HeldOutResult) -> str:
    """The figures besides the loss as a log line says them: "perplexity 12.345, accuracy
    41.20%" (a language model), "accuracy 93.75%", or "" when none could be computed."""
    shown = []
    if "perplexity" in figures:
        shown.append(f"perplexity {figures['perplexity']:.3f}")
    if "accuracy" in figures:
        shown.append(f"accuracy {figures['accuracy']:.2%}")
    return ", ".join(shown)
