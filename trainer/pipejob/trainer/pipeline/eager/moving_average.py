"""spec.ema on the eager path: every stage of every replica keeps the average of its own
parameters (held.py) and the master that of the glue's, each updated after every applied
step; replica 0's stages and the glue are swapped to it for an evaluation or the output (the
replicas are identical: so are their averages), as the traced path's stages are
(pipeline/ema_stages.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline.eager import remote
from pipejob.trainer.pipeline.eager.one_step import Stages
from pipejob.trainer.runtime import ema
from pipejob.trainer.runtime.checkpoint import OptimizerLike
from pipejob.trainer.runtime.optim import Functional


class Averages:
    """The glue's average (None where the glue holds no parameter), the stages' kept there."""

    def __init__(self, spec: PipelineSpec, model: nn.Module, stages: Stages):
        assert spec.ema is not None
        self.stages = stages
        params = list(model.parameters())  # the glue's: the stand-ins hold none
        self.glue = ema.Average(spec.ema, params) if params else None
        stages.on_each(remote.keep_average, spec.ema, replica=None)

    def update(self) -> None:
        """After an applied step (the stages update theirs as they step)."""
        if self.glue is not None:
            self.glue.update()

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside the block, replica 0's stages and the glue hold the average."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        self.stages.on_each(remote.swap_average)
        if self.glue is not None:
            self.glue.swap()


def kept(optimizer: Functional | None, averages: Averages | None) -> dict[str, OptimizerLike]:
    """What the master's checkpoint keeps beside the glue's weights, by key (as a stage's:
    held.py `kept`): the glue's optimizer state and its average."""
    out: dict[str, OptimizerLike] = {} if optimizer is None else {"optimizer": optimizer}
    if averages is not None and averages.glue is not None:
        out[ema.CHECKPOINT_KEY] = averages.glue
    return out
