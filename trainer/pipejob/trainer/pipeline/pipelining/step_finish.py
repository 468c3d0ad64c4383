"""How a pipelining stage process carries out its step's end (step_records.StepEnd), the
engine's counterpart of the rpc engine's round_end.Backward.at_first: where the last round's
call finishes the step (IN_CALL), the pipeline's stage processes gather each one's norm and
the loss in messages (messages.StepFigures, riding with the last backward where a process
holds one piece) and judge the step as the master does; where each steps by its own figures
(ALONE), none is gathered."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipejob.trainer.pipeline import gradients
from pipejob.trainer.pipeline.pipelining import messages
from pipejob.trainer.pipeline.step_records import RoundAsks

if TYPE_CHECKING:
    from pipejob.trainer.pipeline.stage_base import StageBase

NO_CONTEXT = 0  # gradients are in .grad: no context names them


class StepFinish:
    """A stage process's end of its steps, on its pipeline's gloo group (`group`); `last`:
    it holds the last piece, whose figures carry the step's loss."""

    def __init__(self, group: Any, last: bool):
        self.figures = messages.StepFigures(group, 3)  # each process's norm, loss, last or not
        self.last = last

    @staticmethod
    def gathers(asks: RoundAsks) -> bool:
        """Whether a round asked `asks` gathers every process's figures at its end."""
        return asks.finish is not None and asks.unscale is not None and not asks.alone

    def row(self, norm: float, loss: float | None) -> list[float]:
        """This process's figures of a step, as they travel: its norm, the loss, last or not."""
        return [norm, 0.0 if loss is None else loss, float(self.last)]

    def finish(
        self, stage: StageBase, asks: RoundAsks, norm: float | None, loss: float | None
    ) -> None:
        """The step's tail without a call from the master, where `asks` finishes it: alone,
        stepped once this stage's backwards have run, as torch's own loop does (nothing it
        steps by is another stage's: the master judges the step as ever); else judged as
        the master judges it (ReplicasBase.judge: applied where the loss and global norm are
        finite, clipped by that norm) from every process's figures. Either way the
        gradients are forgotten (StageBase.finish_step)."""
        if asks.finish is None or norm is None:
            return
        clip, lr = asks.finish
        if asks.alone:
            stage.finish_step(NO_CONTEXT, 1.0, lr, True, zero=True)
            return
        every = self.figures.gather(self.row(norm, loss)).tolist()
        loss = next(row[1] for row in every if row[2])
        coefficient, applied = gradients.judged_here(loss, [row[0] for row in every], clip)
        stage.finish_step(NO_CONTEXT, coefficient, lr, applied, zero=True)
