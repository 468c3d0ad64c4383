"""The records of the master's step driver (driver.py): how a step ends, decided once for
both engines (`step_end`: `StepEnd`, from the job's `StepShape` and the engine's
`EngineEnds`) and what a round's call asks of the stages for it (`RoundAsks`); a replica's
part of a step (`ReplicaShare`), a forward round's batch on the first stage (`Round`), what
a replica's rounds gave (`RoundsRun`), a replica's step as the master judged it (`Judged`)
and a step's figures (`StepResult`)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pipejob.trainer.pipeline.reader import Batch
from pipejob.trainer.workloads import Loss

Finish = tuple[float | None, float | None]  # a step's clipGradNorm and learning rate


class StepEnd(enum.Enum):
    """How a replica's step ends once its rounds' backwards have run (`step_end`): who brings
    the stages' gradient norms, who judges the step (its loss and global norm finite? the
    clip coefficient) and who clips and steps it."""

    MASTER = "the master asks each stage for its norm, then judges and has them step"
    NORMS_IN_REPLIES = "the last round's replies bring the norms; the master judges and steps"
    IN_CALL = "the last round's call gathers the figures on the stages, judges and steps there"
    ALONE = "the last round's call: each stage steps by its own figures, gathering none"

    @property
    def norms_in_replies(self) -> bool:
        """Whether the last round's replies bring every stage's gradient norm."""
        return self is not StepEnd.MASTER

    @property
    def stepped_by_stages(self) -> bool:
        """Whether the stages step in the last round's call (the master then only judges, to
        report the step as it would have)."""
        return self in (StepEnd.IN_CALL, StepEnd.ALONE)


@dataclass(frozen=True)
class StepShape:
    """What of a job decides how its steps end (`step_end`)."""

    rounds: int  # gradientAccumulation: training rounds a step
    tied: bool  # tied weights: their copies' gradients summed across stages after the rounds
    replicas: int  # more than one: their gradients averaged after the rounds
    scaled: bool  # fp16's loss scale, which the master keeps
    clipped: bool  # optimizer.clipGradNorm: by the global norm, every stage's
    skips_nonfinite: bool  # skipNonFiniteSteps: a step not finite is skipped, not failed


@dataclass(frozen=True)
class EngineEnds:
    """What an engine's stages can do at a step's end (`step_end` reads it)."""

    # The rounds' gradients add up where the backward leaves them (pipelining's .grad): the
    # last round's replies can bring the step's norms after several rounds. The rpc engine
    # adds the earlier rounds' in after the last round's call (gradients.release).
    rounds_add_in_place: bool
    finishes_scaled: bool  # they finish an fp16 step in the call (the master keeps the scale)
    steps_alone: bool  # each can step by its own figures, gathering no other stage's


def step_end(job: StepShape, engine: EngineEnds) -> StepEnd:
    """How a replica's step of `job` ends on `engine`: the one rule both engines' drivers
    follow (ReplicasBase.end)."""
    if job.tied or job.replicas > 1:  # the gradients change after the rounds' backwards
        return StepEnd.MASTER
    if job.rounds > 1 and not engine.rounds_add_in_place:  # the last round's are not the step's
        return StepEnd.MASTER
    # The stages see only the last round's loss; the master keeps fp16's scale.
    if job.rounds > 1 or (job.scaled and not engine.finishes_scaled):
        return StepEnd.NORMS_IN_REPLIES
    # Nothing a stage steps by is another's: no clip by the global norm, no loss scale, and a
    # step not finite fails the job (the master's judgement of it decides nothing they do).
    if engine.steps_alone and not (job.clipped or job.scaled or job.skips_nonfinite):
        return StepEnd.ALONE
    return StepEnd.IN_CALL


@dataclass(frozen=True)
class RoundAsks:
    """What a training round's call asks of the stages at its end, for its step's `StepEnd`
    (ReplicasBase.asks): with `unscale` (1 / fp16's loss scale; 1.0 without one) each
    stage's gradient norm in its reply; with `finish` (the step's clip and learning rate)
    the step finished there too, `alone` (each stage by its own figures) or judged on
    every stage's."""

    unscale: float | None = None
    finish: Finish | None = None
    alone: bool = False


NOTHING = RoundAsks()  # a round that is not its step's last, or a step the master ends


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
