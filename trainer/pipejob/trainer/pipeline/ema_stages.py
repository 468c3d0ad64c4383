"""spec.ema from the master: every stage told to keep its average before the first step (and
before a checkpoint is loaded, which holds it), and replica 0's stages swapped to it for an
evaluation or the output (the replicas are identical: so are their averages)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline.driver import PipelineBase, ReplicasBase
from pipejob.trainer.pipeline.stage_base import StageBase


def keep(spec: PipelineSpec, replicas: ReplicasBase) -> None:
    """Every stage of every replica starts its average from its weights now (spec.ema)."""
    if spec.ema is not None:
        for pipeline in replicas.pipelines:
            pipeline.stage_results(StageBase.keep_average, spec.ema)


@contextmanager
def swapped(pipeline: PipelineBase) -> Iterator[None]:
    """Inside the block, `pipeline`'s stages hold the average in place of their weights."""
    pipeline.stage_results(StageBase.swap_average)
    try:
        yield
    finally:
        pipeline.stage_results(StageBase.swap_average)
