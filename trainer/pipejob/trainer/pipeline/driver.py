"""What the master's step driver does on either engine: `PipelineBase`, its handle on one
replica's remote stages, and `ReplicasBase`, on every replica, whose `step` runs an optimizer
step and ends it with the tail both engines share (`step_result`). Each engine subclasses
both (rpc/driver.py, pipelining/driver.py); the master's loop (train.py) sees only these.
More in docs/architecture.md ("Two pipeline engines, one PipelineJob")."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline import gradients
from pipejob.trainer.pipeline.cut_model import CutModel
from pipejob.trainer.pipeline.reader import TRAIN, Batch, Reader
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.pipeline.stage_calls import (
    Method,
    P,
    R,
    StageRef,
    every_stage_result,
    remote_reader,
    remote_stage,
)
from pipejob.trainer.pipeline.step_records import (
    NOTHING,
    EngineEnds,
    Finish,
    Judged,
    ReplicaShare,
    Round,
    RoundAsks,
    RoundsRun,
    StepEnd,
    StepResult,
    StepShape,
    step_end,
)
from pipejob.trainer.runtime import nonfinite
from pipejob.trainer.runtime.optim import clip_coefficient, learning_rate
from pipejob.trainer.runtime.profiling import phase
from pipejob.trainer.workloads import Loss, batch_values
from pipejob.trainer.workloads.data import FeedState
from pipejob.trainer.workloads.metrics import Tally


class PipelineBase:
    """The master's handle on one pipeline's remote stages (`stages`, each naming its
    worker, created by the engine)."""

    def __init__(self, stages: list[StageRef]):
        self.stages = stages
        remote_stage(stages[-1]).result(StageBase.meet_first, stages[0])
        self.rounds = 0  # forward rounds (training steps and evaluation batches) so far
        self._training: int | None = None  # a training round's samples (the data has no end)

    def read(
        self, micro_batches: int, given: Batch | None = None, what: str = TRAIN
    ) -> Round | None:
        """The next round's batch, on the first stage: `given` (sent there), or read there,
        the next of `what` (TRAIN, or HELD_OUT once `start_held_out`); None when the
        held-out set is over."""
        self.rounds += 1
        if given is not None:  # a view would ship its whole storage
            given = (given[0].clone(), given[1].clone())
        with phase("read"):
            samples = self.reader(Reader.read, self.rounds, micro_batches, what, given)
        if samples == 0:
            return None
        if what == TRAIN and given is None:
            self._training = samples
        return self._round(micro_batches, samples)

    def read_round(self, micro_batches: int, given: Batch | None) -> tuple[Round, int | None]:
        """The next training round and, where its first stage reads it in the call that runs
        it (one call fewer a round; the labels wait for it), the micro-batches it is read
        as; else read now: `given`, or before a training round was read (its size is then
        known, as every one's), or where the engine cannot yet (`reads_in_run`)."""
        if given is None and self.reads_next_in_run(micro_batches):
            assert self._training is not None
            self.rounds += 1
            return self._round(micro_batches, self._training), micro_batches
        round_ = self.read(micro_batches, given)
        assert round_ is not None  # the training data has no end
        return round_, None

    def reads_next_in_run(self, micro_batches: int) -> bool:
        """Whether the next training round is read in the call that runs it (no call before)."""
        samples = self._training
        return samples is not None and self.reads_in_run(micro_batches, samples)

    def reads_in_run(self, micro_batches: int, samples: int) -> bool:
        """Whether a training round of `samples` may be read in the call that runs it."""
        return True

    def _round(self, micro_batches: int, samples: int) -> Round:
        return Round(self.rounds, min(micro_batches, samples), samples)

    def evaluate(self, micro_batches: int, limit: int, loss_fn: Loss, tally: Tally) -> Tally:
        """`tally` with the held-out set's figures (its first `limit` batches, all when 0)."""
        raise NotImplementedError

    def reader(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """What `method` of the first stage's Reader (pipeline/reader.py) returns."""
        return remote_reader(self.stages[0]).result(method, *args, **kwargs)

    def combine_tied(self, context_id: int, tied: list[list[tuple[int, str]]]) -> None:
        """Each parameter several stages hold (tied embeddings, cut.ties; `tied` by stage
        process) gets the sum of its copies' gradients in every copy, as one shared tensor
        would (Megatron's way)."""
        for group in tied:
            grads = torch.futures.wait_all(
                [
                    remote_stage(self.stages[k]).future(StageBase.gradient, context_id, name)
                    for k, name in group
                ]
            )
            total = torch.stack(grads).sum(0)
            torch.futures.wait_all(
                [
                    remote_stage(self.stages[k]).future(
                        StageBase.set_gradient, context_id, name, total
                    )
                    for k, name in group
                ]
            )

    def nonfinite_source(self, rounds: list[int]) -> str:
        """Where a non-finite loss of training rounds `rounds` came from: the first stage
        whose forward gave a non-finite output, else the loss on the last stage."""
        flags = self.stage_results(StageBase.nonfinite, rounds)
        first = next((s.name for s, bad in zip(self.stages, flags, strict=True) if bad), None)
        if first is not None:
            return f"{first}'s forward"
        return f"the loss on {self.stages[-1].name} (from finite outputs)"

    def norms(
        self, context_id: int, unscale: float, leave_out: dict[int, frozenset[str]]
    ) -> list[float]:
        """Each stage's L2 norm of its step's gradients, computed there (StageBase.norm): inf or
        nan when any is; `leave_out`: per stage index, the copies counted elsewhere."""
        return torch.futures.wait_all(
            [
                remote_stage(stage).future(
                    StageBase.norm, context_id, unscale, leave_out.get(k, frozenset())
                )
                for k, stage in enumerate(self.stages)
            ]
        )

    def timings(self, step: int | None = None) -> list[dict[int, tuple[float, float, float]]]:
        return self.stage_results(StageBase.timings, step)

    def stage_results(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """What `method` of every stage, called at once, returns."""
        return every_stage_result(self.stages, method, *args, **kwargs)


class ReplicasBase:
    """Every copy of the pipeline (`pipelines`, one per replica): R replicas each run their
    share of every batch, and their stages average gradients before each optimizer step, so
    they compute what one pipeline computes on their union and stay identical.

    One step: each replica's first stage reads the replica's share of the batch (or a given
    batch is split into one share per replica); each replica runs its share in a thread of
    its own (`_replica_result`, the engine's), so the replicas' pipelines overlap. A
    replica's loss is weighted by its share of the batch (`share`): the replicas' average is
    the whole batch's mean, in the loss and the gradients, at any replica count (an elastic
    world's shares of the one batch of replicas.max may differ by a sample). With
    gradientAccumulation N the step's batch is N batches, run one after the other, each loss
    weighted 1/N; with fp16 the loss is scaled and an overflowed step skipped."""

    # Whether the stages forget a step's gradients once it is stepped or skipped: the
    # pipelining engine's, in .grad (the rpc engine's go with their autograd context).
    zero_grad = False
    engine_ends: EngineEnds  # what the engine's stages can do at a step's end (step_end)

    def __init__(self, pipelines: list[PipelineBase], cut_model: CutModel, spec: PipelineSpec):
        self.pipelines = pipelines
        self.optimizer, self.steps = spec.optimizer, spec.steps
        self.accumulation = spec.gradient_accumulation
        self.batch = spec.batch_size * spec.replicas.max  # of every round, at every size
        self.loss_scale = gradients.LossScale() if spec.precision == "fp16" else None
        self.guard = nonfinite.Guard(spec.skip_non_finite_steps)
        self.tied = cut_model.tied
        shape = StepShape(
            self.accumulation,
            bool(self.tied),
            len(pipelines),
            self.loss_scale is not None,
            self.optimizer.clip_grad_norm is not None,
            self.guard.allowed > 0,
        )
        self.end = step_end(shape, self.engine_ends)  # how every step of the job ends
        self._threads = ThreadPoolExecutor(len(pipelines)) if len(pipelines) > 1 else None

    def step(
        self, micro_batches: int, step: int, loss_fn: Loss, given: Batch | None = None
    ) -> StepResult:
        """One optimizer step on gradientAccumulation batches, one after the other: the
        next ones each first stage reads, or `given` (inputs and labels of them all)."""
        shares, batch = self._shares(given)
        replica_shares = [
            ReplicaShare(r, rounds, micro_batches, step, loss_fn, batch)
            for r, rounds in enumerate(shares)
        ]
        if self._threads is None:
            results = [self._replica_result(replica_shares[0])]
        else:
            results = list(self._threads.map(self._replica_result, replica_shares))
        return self.combined(step, results)

    def run_steps(self, micro_batches: int, steps: range, loss_fn: Loss) -> Iterator[StepResult]:
        """Steps `steps` (0-based), each one's result as it comes: here one after the other;
        an engine may send a step before the last one's result is in (pipelining's)."""
        for step in steps:
            yield self.step(micro_batches, step, loss_fn)

    def combined(self, step: int, results: list[StepResult]) -> StepResult:
        """Step `step` from its replicas' `results`: a non-finite one skipped or failed
        (nonfinite.Guard), fp16's loss scale updated, the figures merged."""
        bad = next((r.nonfinite for r in results if r.nonfinite is not None), None)
        skipped = None if bad is None else self.guard.check(step + 1, *bad)  # or raises
        if self.loss_scale is not None:  # every replica saw the same averaged gradients
            self.loss_scale.update(results[0].grad_norm)
        return StepResult(
            sum(r.loss for r in results) / len(results),
            max(r.pipeline_seconds for r in results),
            max(r.optimizer_seconds for r in results),
            max(r.allreduce_seconds for r in results),
            results[0].lr,
            results[0].grad_norm,
            bad,
            skipped,
        )

    def _shares(self, given: Batch | None) -> tuple[list[list[Batch | None]], int]:
        """Each replica's share of each of a step's batches (None: read by its first stage,
        without `given`) and the samples of each batch."""
        replicas = len(self.pipelines)
        shares: list[list[Batch | None]] = [[None] * self.accumulation for _ in range(replicas)]
        if given is None:
            return shares, self.batch
        inputs, labels = given
        split = batch_values.split  # a dict's tensors too
        rounds = zip(
            split(inputs, self.accumulation), split(labels, self.accumulation), strict=True
        )
        for a, (x, y) in enumerate(rounds):
            for r, share in enumerate(zip(split(x, replicas), split(y, replicas), strict=True)):
                shares[r][a] = share
        return shares, batch_values.samples(inputs) // self.accumulation

    def _replica_result(self, replica_share: ReplicaShare) -> StepResult:
        """A replica's part of a step, run on the engine."""
        raise NotImplementedError

    def unscale(self) -> float:
        """What the stages multiply their gradients by before their norms: 1 / fp16's loss
        scale (1.0 without one)."""
        return 1.0 if self.loss_scale is None else 1.0 / self.loss_scale.scale

    def asks(self, step: int, last: bool) -> RoundAsks:
        """What a training round of step `step` (`last`: the step's last) asks of the stages
        at its end, for the job's `end`: the norms in the replies, and the step finished."""
        if not last or not self.end.norms_in_replies:
            return NOTHING
        finish = self.finish(step) if self.end.stepped_by_stages else None
        return RoundAsks(self.unscale(), finish, self.end is StepEnd.ALONE)

    def step_result(
        self, pipeline: PipelineBase, context_id: int, step: int, ran: RoundsRun
    ) -> StepResult:
        """A replica's step, on either engine, once its rounds' backwards have run (`ran`):
        the tied weights' gradients summed, the replicas' averaged, the step judged (`judge`)
        and, in one call per stage, clipped and stepped where it is applied and, with
        `zero_grad`, the gradients forgotten (`_step_stages`), unless the stages did that
        in the last round's call, judging alike (`end`: round_end.Backward.at_first,
        pipelining's StepFinish.finish)."""
        if self.tied:
            with phase("tied gradients"):
                pipeline.combine_tied(context_id, self.tied)
        middle = time.perf_counter()
        allreduce = 0.0
        if len(self.pipelines) > 1:
            with phase("all-reduce"):
                allreduce = max(pipeline.stage_results(StageBase.average_gradients, context_id))
        with phase("gradient norms"):
            judged = self.judge(pipeline, context_id, step, ran)
        if not self.end.stepped_by_stages and (judged.apply or self.zero_grad):
            self._step_stages(pipeline, context_id, judged)
        return judged.result(middle - ran.start, time.perf_counter() - middle, allreduce)

    def _step_stages(self, pipeline: PipelineBase, context_id: int, judged: Judged) -> None:
        """In one call per stage (StageBase.finish_step): the gradients clipped and the optimizer
        stepped where the step is applied and, with `zero_grad`, the gradients forgotten."""
        with phase("optimizer step"):
            coefficient = clip_coefficient(judged.norm, self.optimizer.clip_grad_norm)
            lr = judged.lr if self.optimizer.schedule is not None else None
            pipeline.stage_results(
                StageBase.finish_step, context_id, coefficient, lr, judged.apply, self.zero_grad
            )

    def finish(self, step: int) -> Finish:
        """Step `step`'s clipping and learning rate, for stages that finish it themselves."""
        lr = learning_rate(self.optimizer, self.steps, step)
        return self.optimizer.clip_grad_norm, lr if self.optimizer.schedule is not None else None

    def judge(self, pipeline: PipelineBase, context_id: int, step: int, ran: RoundsRun) -> Judged:
        """What the master makes of a replica's step once its gradients are in (on its
        stages, in dist-autograd context `context_id`): its mean loss over its training
        rounds (`ran`), the global gradient norm (from the stages' norms, asked for where the
        rounds' replies did not bring them), the learning rate and what was not finite."""
        norms = ran.norms
        if norms is None:
            norms = pipeline.norms(context_id, self.unscale(), gradients.copies(self.tied))
        loss = sum(ran.losses) / len(ran.losses)
        return Judged(
            loss,
            gradients.total_norm(norms),
            learning_rate(self.optimizer, self.steps, step),
            self.nonfinite(pipeline, loss, norms, ran.numbers),
            self.loss_scale is not None,
        )

    def nonfinite(
        self, pipeline: PipelineBase, loss: float, norms: list[float], rounds: list[int]
    ) -> tuple[str, float, str] | None:
        """What of a replica's step (its training rounds `rounds`) was not finite, its value
        and where it came from: the loss, else the gradient norm (`norms`: per stage, which
        fp16's loss scale may overflow: its step is skipped as before); None when both are
        finite. The step is then not applied."""
        if not math.isfinite(loss):
            return "loss", loss, pipeline.nonfinite_source(rounds)
        norm = gradients.total_norm(norms)
        if self.loss_scale is None and not math.isfinite(norm):
            # The backward runs from the last stage to the first: the latest stage whose
            # gradients are not finite is where they became so.
            k = max(k for k, n in enumerate(norms) if not math.isfinite(n))
            return "gradient norm", norm, f"{pipeline.stages[k].name}'s backward"
        return None

    def share(self, round_: Round, batch: int) -> float:
        """A replica's round's part of the round's `batch` samples, times the replicas (1.0
        when the shares are equal): what its loss is weighted by."""
        return round_.samples * len(self.pipelines) / batch

    def activation_peaks(self) -> list[int] | None:
        """Replica 0's stages' most bytes of activations held for their backwards, where the
        engine counts them (None: it does not)."""
        return None

    def evaluate(self, micro_batches: int, limit: int, loss_fn: Loss, tally: Tally) -> Tally:
        """The held-out figures through replica 0 (the replicas are identical)."""
        return self.pipelines[0].evaluate(micro_batches, limit, loss_fn, tally)

    def timings(self, step: int | None = None) -> list[dict[int, tuple[float, float, float]]]:
        """Replica 0's stages' timings, of every finished step or only `step` (every replica
        runs the same schedule)."""
        return self.pipelines[0].timings(step)

    def data_state(self) -> FeedState:
        """The training data's position (every replica's first stage is at the same one)."""
        return self.pipelines[0].reader(Reader.state)

    def readers(self, method: Method[P, Any], *args: P.args, **kwargs: P.kwargs) -> None:
        """Call `method` of every replica's first stage's Reader at once: `load_state` (a
        checkpoint's position), `close` (stop reading)."""
        torch.futures.wait_all(
            [remote_reader(p.stages[0]).future(method, *args, **kwargs) for p in self.pipelines]
        )

    def divergence(self) -> float:
        """The largest difference between a replica's parameter fingerprints and replica
        0's (StageBase.fingerprint): 0.0 while the replicas stay identical, as they must."""
        if len(self.pipelines) == 1:
            return 0.0
        return divergence([p.stage_results(StageBase.fingerprint) for p in self.pipelines])


def divergence(prints: list[list[torch.Tensor]]) -> float:
    """The largest difference between a replica's stages' fingerprints (`prints`: per
    replica, per stage) and replica 0's."""
    return max(
        (
            torch.max((a - b).abs()).item()
            for other in prints[1:]
            for a, b in zip(prints[0], other, strict=True)
        ),
        default=0.0,
    )
