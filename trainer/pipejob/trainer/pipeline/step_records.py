"""The records of the master's step driver (driver.py): a replica's part of a step
(`ReplicaShare`), a forward round's batch on the first stage (`Round`), what a replica's
rounds gave (`RoundsRun`), a replica's step as the master judged it (`Judged`) and a step's
figures (`StepResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipejob.trainer.pipeline.reader import Batch
from pipejob.trainer.workloads import Loss

Finish = tuple[float | None, float | None]  # a step's clipGradNorm and learning rate


@dataclass(frozen=True)
class ReplicaShare:
    """Replica `replica`'s part of an optimizer step (ReplicasBase.step): its share of each of
    the step's batches (`rounds`; None: read by its first stage), of `batch` samples each."""

    replica: int
    rounds: list[Batch | None]
    micro_batches: int
    step: int
    loss_fn: Loss
    batch: int


@dataclass(frozen=True)
class Round:
    """A forward round's batch, read on the first stage: training or evaluation."""

    number: int  # the stages' order of rounds; the last fetches its labels by it
    micro_batches: int  # as the first stage split it: no more than its samples
    samples: int = 0  # in the batch


@dataclass(frozen=True)
class RoundsRun:
    """A replica's training rounds of a step, run: each one's loss (times its share of the
    batch), their numbers (the stages' order of rounds), each stage's gradient norm where the
    last round's replies brought them, and when the first began (time.perf_counter)."""

    losses: list[float]
    numbers: list[int]
    norms: list[float] | None
    start: float


@dataclass(frozen=True)
class StepResult:
    loss: float  # the mean over every replica's batch
    pipeline_seconds: float  # forwards and backwards, all micro-batches (slowest replica)
    optimizer_seconds: float  # averaging gradients across replicas, then stepping
    allreduce_seconds: float = 0.0  # of which the slowest stage's all-reduce
    lr: float | None = None  # the learning rate the optimizer stepped with
    grad_norm: float | None = None  # the global gradient norm before clipping
    # A figure that was not finite, its value and where it came from (runtime/nonfinite.py):
    # the step was not applied.
    nonfinite: tuple[str, float, str] | None = None
    skipped: str | None = None  # the line saying that the Guard let the step be skipped


@dataclass(frozen=True)
class Judged:
    """A replica's step as the master judged it before the optimizer steps (ReplicasBase.judge)."""

    loss: float  # the mean over its rounds
    norm: float  # the global gradient norm before clipping
    lr: float | None  # what the optimizer steps with
    nonfinite: tuple[str, float, str] | None  # what was not finite: the step is not applied
    scaled: bool  # fp16's loss scale: an overflowed step is skipped, not judged non-finite

    @property
    def apply(self) -> bool:
        return self.nonfinite is None and (not self.scaled or math.isfinite(self.norm))

    def result(
        self, pipeline_seconds: float, optimizer_seconds: float, allreduce_seconds: float
    ) -> StepResult:
        return StepResult(
            self.loss,
            pipeline_seconds,
            optimizer_seconds,
            allreduce_seconds,
            self.lr,
            self.norm,
            self.nonfinite,
        )
