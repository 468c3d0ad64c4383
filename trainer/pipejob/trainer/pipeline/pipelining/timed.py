"""The pipelining engine's PipelineStage (`Timed`): torch's, marking when it computes
(compute_marks.py) for the summary's per-stage times and bubble, checking its outputs, and
letting a step's figures ride with its last backward's messages (PipeliningStage.ride_in,
PipeliningStage.ride_out)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.distributed.pipelining import PipelineStage

if TYPE_CHECKING:
    from pipejob.trainer.pipeline.pipelining.stage import PipeliningStage


class Timed(PipelineStage):
    """A PipelineStage of `owner`'s that marks when it computes (compute_marks.py), for the
    summary's per-stage times and bubble; its backward's messages carry the step's figures
    where the owner's round has them ride (PipeliningStage.ride_in, PipeliningStage.ride_out)."""

    def __init__(self, owner: PipeliningStage, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.owner = owner

    # Marked without a context manager: a generator's per micro-batch cost shows on tiny stages.
    def forward_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> Any:
        marks = self.owner.marks
        start = marks.mark()
        with self.owner.counting():
            output = super().forward_one_chunk(chunk, *args, **kwargs)
        marks.interval("forward", start)
        self.owner.forwarded(output)
        return output

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = self.owner.marks.mark()
        output = super().backward_one_chunk(*args, **kwargs)
        self.owner.marks.interval("backward", start)
        return output

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
        self.owner.waits(self.stage_index, bwd_chunk_id)  # what need not delay a send
        return self.owner.ride_in(super().get_bwd_recv_ops(bwd_chunk_id), bwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
        return self.owner.ride_out(super().get_bwd_send_ops(bwd_chunk_id), bwd_chunk_id)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = self.owner.marks.mark()
        output = super().backward_weight_one_chunk(*args, **kwargs)
        self.owner.marks.interval("backward", start)
        return output
