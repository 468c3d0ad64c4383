"""What ends a round on the rpc engine, sent along the pipeline with the round's last
micro-batch (Stage.pass_on): the last stage ends the round (`at_last`), and each other stage
adds its part to the result as it passes back to the first (`on_the_way`), whose reply to the
master brings it. One call from the master a round, where the settle was a call a stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipejob.trainer.workloads import Loss
from pipejob.trainer.workloads.metrics import Tally

if TYPE_CHECKING:
    from pipejob.trainer.pipeline.rpc.stage import Stage

Norms = list[float] | None  # each stage's gradient norm, first stage first, where asked for


@dataclass(frozen=True)
class Backward:
    """A training round's end: on the last stage the round's loss and the distributed
    backward from it times `scale` (Stage.loss_backward); then each other stage settled
    (Stage.settle), only after the backward has returned there: a stage's settle ends just
    before the gradients its nodes nearest the inputs give its parameters are taken into the
    context, which that return waits for. With `unscale` (the step's last round: 1 / fp16's
    loss scale) each stage's gradient norm comes too. Gives the loss and the norms."""

    loss_fn: Loss
    context_id: int
    scale: float
    step: int
    unscale: float | None

    def at_last(self, stage: Stage, round: int, micro_batches: int) -> tuple[torch.Tensor, Norms]:
        loss, norm = stage.loss_backward(
            round, micro_batches, self.loss_fn, self.context_id, self.scale, self.step, self.unscale
        )
        return loss, None if norm is None else [norm]

    def on_the_way(
        self, stage: Stage, micro_batches: int, ended: tuple[torch.Tensor, Norms]
    ) -> tuple[torch.Tensor, Norms]:
        stage.settle(self.step, micro_batches)
        loss, norms = ended
        if self.unscale is None or norms is None:
            return ended
        return loss, [stage.norm(self.context_id, self.unscale), *norms]


@dataclass(frozen=True)
class Figures:
    """An evaluation round's end: `tally` with the round's figures added on the last stage
    (Stage.tally), unchanged on the way back."""

    loss_fn: Loss
    tally: Tally

    def at_last(self, stage: Stage, round: int, micro_batches: int) -> Tally:
        return stage.tally(round, micro_batches, self.loss_fn, self.tally)

    def on_the_way(self, stage: Stage, micro_batches: int, ended: Any) -> Any:
        return ended


RoundEnd = Backward | Figures
