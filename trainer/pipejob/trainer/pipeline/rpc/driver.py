"""The rpc engine's step driver, on the master: micro-batches pipelined through the remote
stages over RPC (GPipe: all forwards of a step, then all backwards, then every stage's
optimizer step); what both engines' drivers share is pipeline/driver.py's. How a step moves:
docs/architecture.md ("The rpc engine")."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.core.optimizer import Optimizer
from pipejob.trainer.pipeline import driver, gradients
from pipejob.trainer.pipeline.cut_model import CutModel
from pipejob.trainer.pipeline.reader import HELD_OUT, Batch, Reader, Source
from pipejob.trainer.pipeline.rpc.round_end import Backward, EvaluationEnd, Norms, RoundEnd
from pipejob.trainer.pipeline.rpc.stage import RpcStage
from pipejob.trainer.pipeline.stage_calls import created_stages, remote_stage
from pipejob.trainer.pipeline.step_records import (
    NOTHING,
    EngineEnds,
    ReplicaShare,
    Round,
    RoundAsks,
    RoundsRun,
    StepResult,
)
from pipejob.trainer.runtime.profiling import phase
from pipejob.trainer.workloads import Loss
from pipejob.trainer.workloads.metrics import Tally


class RpcPipeline(driver.PipelineBase):
    """The master's handle on the remote stages: creates them and runs micro-batches (every
    call through pipeline/stage_calls.py, which says why)."""

    def __init__(
        self,
        stage_names: list[str],
        cut_model: CutModel,
        device: str = "cpu",
        precision: str = "fp32",
        recompute: bool = False,
        source: Source | None = None,
        optimizer: Optimizer | None = None,
    ):
        """`source`: where the first stage reads the training and held-out batches; without
        it, every round's batch is given (`read`). `optimizer`: what each stage steps its
        shard with (none: the caller steps the parameters itself)."""
        last = len(stage_names) - 1
        args = [
            (
                cut_model.builders[i] if cut_model.builders else cut_model.stages[i],
                i == last,
                device,
                precision,
                recompute,
                source if i == 0 else None,
                optimizer,
            )
            for i in range(last + 1)
        ]
        super().__init__(created_stages(stage_names, RpcStage, args))
        # Each stage passes its outputs straight to the next (RpcStage.pass_on).
        every = self.stages
        torch.futures.wait_all(
            [remote_stage(every[k]).future(RpcStage.link, every[k + 1 :]) for k in range(last)]
        )

    def forward(
        self, batch: Round, step: int | None, end: RoundEnd, read: int | None = None
    ) -> Any:
        """All micro-batches' forwards of `batch`, pipelined, and the round ended by `end`
        (round_end.py), whose result this returns: one call to the first stage, which passes
        each micro-batch on as it computes it, each stage to the next, the last ending the
        round (RpcStage.forward_round). `step` None: an evaluation's forwards (no autograd,
        shards in eval mode). `read`: the first stage reads the round in its first forward,
        as that many micro-batches (`read_round`: one call fewer a round)."""
        reads = None if read is None else (read, batch.samples)
        return remote_stage(self.stages[0]).result(
            RpcStage.forward_round, batch.number, batch.micro_batches, step, reads, end
        )

    def evaluate(self, micro_batches: int, limit: int, loss_fn: Loss, tally: Tally) -> Tally:
        """`tally` with the held-out set's figures (its first `limit` batches, all when 0):
        the first stage reads each batch, the last adds its figures (RpcStage.tally)."""
        self.reader(Reader.start_held_out, limit)
        while (batch := self.read(micro_batches, what=HELD_OUT)) is not None:
            tally = self.forward(batch, None, EvaluationEnd(loss_fn, tally))
        return tally


def forward_backward(
    pipeline: RpcPipeline,
    batch: Round,
    step: int,
    context_id: int,
    loss_fn: Loss,
    scale: float = 1.0,
    read: int | None = None,
    asks: RoundAsks = NOTHING,
) -> tuple[torch.Tensor, Norms]:
    """Every micro-batch of `batch` forward, then on the last stage one loss over the whole
    batch (the mean over its samples, as without a pipeline) and the backward across the
    stages of the loss times `scale` (1 / gradientAccumulation, times fp16's loss scale),
    every other stage settled as the reply passes back (round_end.Backward), in one call.
    Returns the loss, and where `asks` the norms each stage's; where it asks the step
    finished, the first stage has finished it."""
    with phase("forwards and backward"):
        end = Backward(loss_fn, context_id, scale, step, asks)
        return pipeline.forward(batch, step, end, read)


class RpcReplicas(driver.ReplicasBase):
    """Every copy of the pipeline, each stage with its own optimizer.

    Each replica runs its share's forwards and backwards in a dist-autograd context of its
    own, then its stages average their gradients with the same stage of the other replicas
    (`RpcStage.average_gradients`) and its optimizer steps. With gradientAccumulation the
    rounds' gradients add up on the stages into the last round's context. Before the
    optimizer steps, the replica's stages give their gradients' global norm, which clips
    them (gradients.py), and the stages step with the schedule's learning rate."""

    # The rounds before the last add in after its call (gradients.release); the master
    # keeps fp16's loss scale and judges such a step.
    engine_ends = EngineEnds(rounds_add_in_place=False, finishes_scaled=False, steps_alone=False)

    def __init__(
        self, names: list[list[str]], cut_model: CutModel, spec: PipelineSpec, device: str = "cpu"
    ):
        pipelines = [
            RpcPipeline(
                stage_names,
                cut_model,
                device,
                spec.precision,
                spec.activation_checkpointing,
                Source(spec, r, len(names)),
                spec.optimizer,
            )
            for r, stage_names in enumerate(names)
        ]
        super().__init__(pipelines, cut_model, spec)

    def _replica_result(self, replica_share: ReplicaShare) -> StepResult:
        pipeline = self.pipelines[replica_share.replica]
        rounds, step = replica_share.rounds, replica_share.step
        stages = pipeline.stages
        scale = 1.0 if self.loss_scale is None else self.loss_scale.scale

        numbers: list[int] = []  # the forward rounds of the step
        norms: list[float] | None = None  # where the last round's reply brings them (`end`)

        def round_loss(given: Batch | None, context_id: int, last: bool) -> float:
            nonlocal norms
            round_, read = pipeline.read_round(replica_share.micro_batches, given)
            numbers.append(round_.number)
            share = self.share(round_, replica_share.batch)
            weight = scale * share / len(rounds)  # each batch's share of the step's loss
            asks = self.asks(step, last)
            loss, norms = forward_backward(
                pipeline, round_, step, context_id, replica_share.loss_fn, weight, read, asks
            )
            return loss.item() * share

        start = time.perf_counter()
        losses = []
        # A context takes one backward: the rounds before the last each have their own, and
        # the stages hold their gradients until the last round's context, where they add up.
        for given in rounds[:-1]:
            with dist_autograd.context() as context_id:
                losses.append(round_loss(given, context_id, False))
                with phase("accumulate"):
                    gradients.hold(stages, context_id)
        with dist_autograd.context() as context_id:
            losses.append(round_loss(rounds[-1], context_id, True))
            if len(rounds) > 1:
                with phase("accumulate"):
                    gradients.release(stages, context_id)
            ran = RoundsRun(losses, numbers, norms, start)
            return self.step_result(pipeline, context_id, step, ran)
