"""What a pipeline's stage processes tell each other besides the schedule's activations, in
point-to-point messages on the pipeline's gloo group (groups.py: CPU tensors, whatever the
pipeline's own backend): a training round's labels, from the first process, whose reader
has them, to the last, whose loss needs them; and a step's figures, gathered by every
process. Messages, not RPCs or gloo's collectives: on 2 cores shared by 4 processes, gloo's
all_gather of a few numbers measured 6.6 CPU-ms a call, a chain of 3 messages 1.1
(docs/user-guide.md, "The engines' own costs")."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

LABELS, FIGURES = 1, 2  # the messages' tags
DTYPES = [
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
]
MOST_DIMS = 8
Sending = list[tuple[Any, torch.Tensor]]  # the sends under way and the tensors they hold


def pass_labels(labels: torch.Tensor, group: Any, before: Sending) -> Sending:
    """Send a round's `labels` from the first process of `group` to its last: their dtype
    and shape, then their values. The sends `before` (the last round's) end first, so their
    tensors may go."""
    for work, _ in before:
        work.wait()
    if labels.dtype not in DTYPES or labels.dim() > MOST_DIMS:
        raise ValueError(
            f"the data's labels are {labels.dtype} of {labels.dim()} dimensions: a pipeline"
            f" passes labels of {', '.join(map(str, DTYPES))} of at most {MOST_DIMS}"
        )
    labels = labels.detach().cpu().contiguous()
    shape = [*labels.shape, *[0] * (MOST_DIMS - labels.dim())]
    header = torch.tensor([DTYPES.index(labels.dtype), labels.dim(), *shape])
    last = _rank(group, dist.get_world_size(group) - 1)
    return [(dist.isend(t, last, group=group, tag=LABELS), t) for t in (header, labels)]


def take_labels(group: Any) -> torch.Tensor:
    """On the last process of `group`: the next round's labels, from the first."""
    first = _rank(group, 0)
    header = torch.empty(2 + MOST_DIMS, dtype=torch.int64)
    dist.recv(header, first, group=group, tag=LABELS)
    dtype, dims = DTYPES[int(header[0])], int(header[1])
    labels = torch.empty(header[2 : 2 + dims].tolist(), dtype=dtype)
    dist.recv(labels, first, group=group, tag=LABELS)
    return labels


def gather(row: list[float], group: Any) -> torch.Tensor:
    """Every process's `row` (one length for all), by its rank in `group`, on every
    process: passed from the last process to the first, as the backward ends there last,
    each adding its own, then sent by the first to every other."""
    count, me = dist.get_world_size(group), dist.get_rank(group)
    rows = torch.zeros(count, len(row), dtype=torch.float64)
    rows[me] = torch.tensor(row, dtype=torch.float64)
    if me < count - 1:
        below = torch.empty(count - me - 1, len(row), dtype=torch.float64)
        dist.recv(below, _rank(group, me + 1), group=group, tag=FIGURES)
        rows[me + 1 :] = below
    if me > 0:
        dist.send(rows[me:], _rank(group, me - 1), group=group, tag=FIGURES)  # rows: contiguous
        dist.recv(rows, _rank(group, 0), group=group, tag=FIGURES)
        return rows
    sends = [dist.isend(rows, _rank(group, k), group=group, tag=FIGURES) for k in range(1, count)]
    for work in sends:
        work.wait()
    return rows


def _rank(group: Any, rank: int) -> int:
    """The world rank of `group`'s process `rank` (what send and recv take)."""
    return dist.get_global_rank(group, rank)
