"""What a pipeline's stage processes tell each other besides the schedule's activations, in
point-to-point messages on the pipeline's gloo group (groups.py: CPU tensors, whatever the
pipeline's own backend): a training round's labels, from the first process, whose reader
has them, to the last, whose loss needs them; and a step's figures, gathered by every
process. Messages, not RPCs or gloo's collectives: on 2 cores shared by 4 processes, gloo's
all_gather of a few numbers measured 6.6 CPU-ms a call, a chain of 3 messages 1.1.

gloo sends a message once its receiver has posted the receive, so a receive posted only when
its value is needed waits a round trip more: each side posts its receives ahead (`expect`),
and a round's labels travel as one message, their dtype and shape in front of their bytes
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
HEADER = 8 * (2 + MOST_DIMS)  # bytes in front of a message's labels: dtype, dims, shape
ROOM = 1 << 20  # bytes a receive posted ahead holds: larger labels follow their header alone


class LabelsOut:
    """The first process of `group`: sends each training round's labels to its last."""

    def __init__(self, group: Any):
        self.group = group
        self._last = _rank(group, dist.get_world_size(group) - 1)
        self._sending: list[tuple[Any, torch.Tensor]] = []  # the sends under way, their data

    def send(self, labels: torch.Tensor) -> None:
        """Send a round's `labels`: in one message where they fit in ROOM, else their header,
        then their bytes. The last round's sends end first, so their tensors may go."""
        for work, _ in self._sending:
            work.wait()
        if labels.dtype not in DTYPES or labels.dim() > MOST_DIMS:
            raise ValueError(
                f"the data's labels are {labels.dtype} of {labels.dim()} dimensions: a pipeline"
                f" passes labels of {', '.join(map(str, DTYPES))} of at most {MOST_DIMS}"
            )
        data = labels.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        shape = [*labels.shape, *[0] * (MOST_DIMS - labels.dim())]
        header = torch.tensor([DTYPES.index(labels.dtype), labels.dim(), *shape]).view(torch.uint8)
        parts = [torch.cat([header, data])] if HEADER + data.numel() <= ROOM else [header, data]
        self._sending = [
            (dist.isend(part, self._last, group=self.group, tag=LABELS), part) for part in parts
        ]


class LabelsIn:
    """The last process of `group`: takes each training round's labels from its first."""

    def __init__(self, group: Any):
        self.group = group
        self._first = _rank(group, 0)
        self._posted: tuple[Any, torch.Tensor] | None = None  # the next message's receive
        # Two receives' room, used in turn: a round's labels are a view of one while the next
        # round's arrive in the other (a fresh megabyte a round cost the allocator's work).
        self._rooms: list[torch.Tensor] = []

    def expect(self) -> None:
        """Post the receive of the next round's labels (sent while this round runs), into the
        room the round before this one's labels used."""
        if not self._rooms:
            self._rooms = [torch.empty(ROOM, dtype=torch.uint8) for _ in range(2)]
        room = self._rooms.pop(0)
        self._rooms.append(room)
        self._posted = dist.irecv(room, self._first, group=self.group, tag=LABELS), room

    def take(self) -> torch.Tensor:
        """The next round's labels, once they are in."""
        if self._posted is None:
            self.expect()
        assert self._posted is not None
        (work, room), self._posted = self._posted, None
        work.wait()
        header = room[:HEADER].view(torch.int64).tolist()
        dtype, dims = DTYPES[header[0]], header[1]
        shape = header[2 : 2 + dims]
        size = dtype.itemsize * torch.Size(shape).numel()
        if HEADER + size <= ROOM:
            data = room[HEADER : HEADER + size]
        else:
            data = torch.empty(size, dtype=torch.uint8)
            dist.recv(data, self._first, group=self.group, tag=LABELS)
        return data.view(dtype).reshape(shape)


class StepFigures:
    """A step's figures: every process's row of `width` numbers, by its rank in `group`, on
    every process, passed from the last process to the first, as the backward ends there
    last, each adding its own, then sent by the first to every other."""

    def __init__(self, group: Any, width: int):
        self.group, self.width = group, width
        self.count, self.me = dist.get_world_size(group), dist.get_rank(group)
        self._below: tuple[Any, torch.Tensor] | None = None  # the rows after this one's
        self._every: tuple[Any, torch.Tensor] | None = None  # every row, from the first
        # Where they arrive, step after step: a step's are read before the next's are posted.
        self._rooms = (
            torch.empty(self.count - self.me - 1, width, dtype=torch.float64),
            torch.empty(self.count, width, dtype=torch.float64),
        )
        self._arrived = False  # the rows after this one's came with the schedule's messages
        self._up: torch.Tensor | None = None  # this step's rows, sent up with them (`up`)

    def expect(self, riding: bool = False) -> None:
        """Post this process's receives of the next step's figures; `riding`: those of the
        rows after its own go with the schedule's last backward (`below`, `up`)."""
        below, every = self._rooms
        self._arrived, self._up = False, None
        if self.me < self.count - 1 and not riding:
            self._below = self._recv(below, self.me + 1), below
        if self.me > 0:
            self._every = self._recv(every, 0), every

    def below(self) -> dist.P2POp:
        """The receive of the rows after this process's, for a schedule to post with its
        receive of the last backward's gradients from the next process, which sends them
        with those gradients (`up`): they arrive as the backward does, with no wait of
        their own."""
        self._arrived = True
        return dist.P2POp(
            dist.irecv, self._rooms[0], self._global(self.me + 1), self.group, FIGURES
        )

    def up(self, row: list[float]) -> dist.P2POp:
        """The send of this process's `row` and the rows after it (in by now: they came with
        the gradients its last backward took) to the process before, for a schedule to send
        with the last backward's gradients."""
        self._up = self._rows(row)
        sent = self._up[self.me :]
        return dist.P2POp(dist.isend, sent, self._global(self.me - 1), self.group, FIGURES)

    def gather(self, row: list[float]) -> torch.Tensor:
        """Every process's row of the step, this one's `row` among them."""
        if self._below is None and self._every is None and self._up is None and not self._arrived:
            self.expect()
        if self._up is not None:  # sent up already, with the schedule's messages
            rows, self._up = self._up, None
        else:
            rows = self._rows(row)
            if self._every is not None:
                up = rows[self.me :]
                dist.send(up, self._global(self.me - 1), group=self.group, tag=FIGURES)
        if self._every is not None:
            (work, every), self._every = self._every, None
            work.wait()
            return every.clone()  # its room takes the next step's
        for work in [self._send(rows, k) for k in range(1, self.count)]:
            work.wait()
        return rows

    def _rows(self, row: list[float]) -> torch.Tensor:
        """This process's `row` and the rows after it, once in, in their places."""
        rows = torch.zeros(self.count, self.width, dtype=torch.float64)
        rows[self.me] = torch.tensor(row, dtype=torch.float64)
        if self._below is not None:
            (work, below), self._below = self._below, None
            work.wait()
            rows[self.me + 1 :] = below
        elif self._arrived:
            rows[self.me + 1 :] = self._rooms[0]
        self._arrived = False
        return rows

    def _recv(self, tensor: torch.Tensor, rank: int) -> Any:
        return dist.irecv(tensor, self._global(rank), group=self.group, tag=FIGURES)

    def _send(self, tensor: torch.Tensor, rank: int) -> Any:
        return dist.isend(tensor, self._global(rank), group=self.group, tag=FIGURES)

    def _global(self, rank: int) -> int:
        return _rank(self.group, rank)


def _rank(group: Any, rank: int) -> int:
    """The world rank of `group`'s process `rank` (what send and recv take)."""
    return dist.get_global_rank(group, rank)
