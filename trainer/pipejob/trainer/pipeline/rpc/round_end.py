"""What ends a round on the rpc engine, sent along the pipeline with the round's last
micro-batch (RpcStage.pass_on): the last stage ends the round (`at_last`), and each other stage
adds its part to the result as it passes back to the first (`on_the_way`), which may finish
the step (`at_first`) before its reply brings the result to the master: one call from the
master a round, where the settle and the optimizer's step were a call a stage each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipejob.trainer.pipeline import gradients
from pipejob.trainer.pipeline.step_records import RoundAsks
from pipejob.trainer.workloads import Loss
from pipejob.trainer.workloads.metrics import Tally

if TYPE_CHECKING:
    from pipejob.trainer.pipeline.rpc.stage import RpcStage

Norms = list[float] | None  # each stage's gradient norm, first stage first, where asked for


@dataclass(frozen=True)
class Backward:
    """A training round's end: on the last stage the round's loss and the distributed
    backward from it times `scale` (RpcStage.loss_backward); then each other stage settled
    (RpcStage.settle), only after the backward has returned there: a stage's settle ends just
    before the gradients its nodes nearest the inputs give its parameters are taken into the
    context, which that return waits for. Where `asks` (the step's last round; its
    `unscale` is 1 / fp16's loss scale) each stage's gradient norm comes too. Gives the loss
    and the norms. Where it asks the step finished (`finish`), the first stage then finishes
    it on every stage (`at_first`): the rpc engine's carrying out of StepEnd.IN_CALL."""

    loss_fn: Loss
    context_id: int
    scale: float
    step: int
    asks: RoundAsks

    def at_last(
        self, stage: RpcStage, round: int, micro_batches: int
    ) -> tuple[torch.Tensor, Norms]:
        loss, norm = stage.loss_backward(
            round,
            micro_batches,
            self.loss_fn,
            self.context_id,
            self.scale,
            self.step,
            self.asks.unscale,
        )
        return loss, None if norm is None else [norm]

    def on_the_way(
        self, stage: RpcStage, micro_batches: int, ended: tuple[torch.Tensor, Norms]
    ) -> tuple[torch.Tensor, Norms]:
        stage.settle(self.step, micro_batches)
        loss, norms = ended
        if norms is None:  # no `unscale`: the norms are not asked for
            return ended
        return loss, [stage.norm(self.context_id, self.asks.unscale), *norms]

    def at_first(self, stage: RpcStage, ended: tuple[torch.Tensor, Norms]) -> Any:
        """Where `asks` the step finished, it is judged as the master judges it, then clipped
        and stepped on every stage at once (RpcStage.finish_all): the step's tail without a
        call from the master, which judges the same figures alike."""
        loss, norms = ended
        if self.asks.finish is None or norms is None:
            return ended
        clip, lr = self.asks.finish
        coefficient, applied = gradients.judged_here(loss.item(), norms, clip)
        stage.finish_all(self.context_id, coefficient, lr, applied)
        return ended


@dataclass(frozen=True)
class EvaluationEnd:
    """An evaluation round's end: `tally` with the round's figures added on the last stage
    (RpcStage.tally), unchanged on the way back."""

    loss_fn: Loss
    tally: Tally

    def at_last(self, stage: RpcStage, round: int, micro_batches: int) -> Tally:
        return stage.tally(round, micro_batches, self.loss_fn, self.tally)

    def on_the_way(self, stage: RpcStage, micro_batches: int, ended: Any) -> Any:
        return ended

    def at_first(self, stage: RpcStage, ended: Any) -> Any:
        return ended


RoundEnd = Backward | EvaluationEnd
