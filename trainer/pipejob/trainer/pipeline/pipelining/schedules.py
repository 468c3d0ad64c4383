"""spec.schedule as torch.distributed.pipelining's schedule classes, and the forward-only
schedule an evaluation runs. Only their public constructors and `step` are used, in the form
every pinned torch version has (torch 2.11 and 2.13)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)

from pipejob.core.kinds.pipeline_schedules import GPIPE, INTERLEAVED, ONE_F_ONE_B, ZERO_BUBBLE

# One stage per process, or several (the interleaved ones: stage k on process k % processes).
SINGLE = {GPIPE: ScheduleGPipe, ONE_F_ONE_B: Schedule1F1B}
MULTI = {INTERLEAVED: ScheduleInterleaved1F1B, ZERO_BUBBLE: ScheduleInterleavedZeroBubble}


def training(
    schedule: str, stages: list[PipelineStage], micro_batches: int, loss: Callable[..., Any]
) -> Any:
    """The job's schedule over this process's `stages`. Gradients are not divided by the
    micro-batch count after the backwards (scale_grads): the loss is weighted instead, so the
    rounds of gradientAccumulation add up in .grad as they come."""
    if schedule in SINGLE:
        return SINGLE[schedule](stages[0], micro_batches, loss_fn=loss, scale_grads=False)
    return MULTI[schedule](stages, micro_batches, loss_fn=loss, scale_grads=False)


def forward_only(stages: list[PipelineStage], micro_batches: int) -> Any:
    """Every micro-batch forward through this process's `stages`, nothing backward (no loss):
    GPipe's forwards, or LoopedBFS's for several stages per process on the interleaved
    schedules' loop."""
    if len(stages) == 1:
        return ScheduleGPipe(stages[0], micro_batches)
    return ScheduleLoopedBFS(stages, micro_batches)
