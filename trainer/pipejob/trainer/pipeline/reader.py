"""A PipelineJob's data, read where it is first needed: on the first stage of each replica,
one batch ahead in a thread of its own; the master never holds an input batch.
docs/architecture.md ("Where a PipelineJob's model and data live") says where each part lives."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, TypeVarTuple

import torch

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.workloads import batch_values, data
from pipejob.trainer.workloads.data import Batch, FeedState

T = TypeVar("T")
Args = TypeVarTuple("Args")
TRAIN, HELD_OUT = "train", "held-out"


@dataclass(frozen=True)
class Source:
    """Where a replica's first stage reads: the job's data, replica `replica`'s share of
    every batch among the world's `replicas` (default: replicas.max)."""

    spec: PipelineSpec
    replica: int
    replicas: int | None = None


class Reader:
    """The rounds' batches on a first stage: read here from `source` (or given), kept until
    the stage's forwards and the last stage's loss take them."""

    def __init__(self, source: Source | None, device: torch.device):
        self.source, self.device = source, device
        self._feed: data.Feed | None = None
        self._held: data.HeldOut | None = None
        self._looked = False  # for the held-out set (the data may have none)
        # The running evaluation's held-out batches.
        self._held_batches: Iterator[Batch] | None = None
        # The next training batch, being read, and the feed's state before it (what a
        # checkpoint keeps: the batches handed out, not the one read ahead).
        self._ahead: tuple[dict[str, Any], Future[Batch]] | None = None
        # Everything that touches a DataLoader runs in this thread: worker processes forked
        # from one thread fail on exit when another thread shuts them down. Reading here
        # (decoding, a synthetic batch's drawing, the copy to the GPU) overlaps the
        # computing of the batch before.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pipejob-reader")
        # A lock that also says when a round's labels arrive (`labels` may be asked first).
        self._lock = threading.Condition()
        self._inputs: dict[tuple[int, int], tuple[torch.Tensor]] = {}
        self._labels: dict[int, torch.Tensor] = {}

    def read(
        self, round: int, micro_batches: int, what: str = TRAIN, given: Batch | None = None
    ) -> int:
        """Round `round`'s batch: `given` (tests, and anything that brings its own tensors),
        or the next one of `what` (TRAIN or HELD_OUT), kept as at most `micro_batches`
        micro-batches; its sample count, 0 when the held-out set is over."""
        batch = given if given is not None else self._next(what)
        if batch is None:
            return 0
        inputs, labels = batch
        inputs = batch_values.to(inputs, self.device)  # a dict of inputs too
        with self._lock:  # a round that failed half-way leaves inputs no forward will take
            self._inputs = {k: v for k, v in self._inputs.items() if k[0] > round}
            self._labels = {k: v for k, v in self._labels.items() if k > round}
            samples = batch_values.samples(inputs)
            parts = batch_values.split(inputs, min(micro_batches, samples))
            self._inputs |= {(round, mb): (x,) for mb, x in enumerate(parts)}
            self._labels[round] = labels
            self._lock.notify_all()
        return samples

    def read_planned(self, round: int, micro_batches: int, samples: int) -> None:
        """A training round read in the call that runs it (`read`), refused unless it has the
        `samples` the master planned the round with (every training round's size)."""
        got = self.read(round, micro_batches)
        if got != samples:
            raise RuntimeError(f"training round {round} has {got} samples, not {samples}")

    def input(self, round: int, micro_batch: int) -> tuple[torch.Tensor]:
        """Micro-batch `micro_batch` of round `round`'s inputs, for the stage's forward. On
        a GPU the forward runs on its RPC call's stream (the RPC agent's pool), not on the
        one the inputs were copied on: their memory must wait for that stream's work before
        it is reused."""
        with self._lock:
            x = self._inputs.pop((round, micro_batch))
        for t in batch_values.tensors(x):
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))
        return x

    def inputs(self, round: int) -> torch.Tensor:
        """Round `round`'s inputs whole, for a stage whose schedule splits them itself."""
        with self._lock:
            count = sum(1 for r, _ in self._inputs if r == round)
        parts = [self.input(round, mb)[0] for mb in range(count)]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)

    def metas(self, round: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of each input of round `round`'s micro-batches."""
        with self._lock:
            return [(tuple(x.shape), x.dtype) for x in self._inputs[round, 0]]

    def labels(self, round: int, timeout: float = 0.0) -> torch.Tensor:
        """Round `round`'s labels, for the last stage's loss or evaluation; waiting up to
        `timeout` seconds for the round to be read (the pipelining engine's first stage
        reads a training round in the call that runs it: pipelining/stage.py's `train`)."""
        with self._lock:
            if not self._lock.wait_for(lambda: round in self._labels, timeout):
                raise KeyError(f"round {round} was not read within {timeout:g}s")
            return self._labels.pop(round)

    def held_out(self) -> str | None:
        """The held-out set's description; None when the data has none."""
        if not self._looked:
            self._held, self._looked = data.held_out(self._source().spec), True
        return None if self._held is None else self._held.description

    def start_held_out(self, limit: int) -> None:
        """Begin an evaluation's pass over the held-out set: its first `limit` batches, all
        when 0."""
        if self.held_out() is None:
            raise RuntimeError("the data has no held-out set to evaluate on")
        assert self._held is not None
        self._held_batches = self._held.batches(limit)

    def state(self) -> FeedState:
        """The training feed's position, for a checkpoint."""
        return self._ahead[0] if self._ahead is not None else self._training().state()

    def load_state(self, state: FeedState) -> None:
        """Continue the training feed after a checkpoint's position."""
        self._drop_ahead()
        self._in_thread(self._training().load_state, state)

    def close(self) -> None:
        """Stop reading: the feeds' DataLoader workers, and the thread."""
        self._drop_ahead()
        for source in (self._feed, self._held):
            if source is not None:
                self._in_thread(source.close)
        self._thread.shutdown()

    def _source(self) -> Source:
        if self.source is None:
            raise RuntimeError("this pipeline was given no data source: give each round's batch")
        return self.source

    def _training(self) -> data.Feed:
        if self._feed is None:
            source = self._source()
            self._feed = data.Feed(source.spec, source.replica, source.replicas)
        return self._feed

    def _in_thread(self, function: Callable[[*Args], T], *args: *Args) -> T:
        """`function(*args)` in the reader's thread, waited for."""
        return self._thread.submit(function, *args).result()

    def _next(self, what: str) -> Batch | None:
        if what == HELD_OUT:
            if self._held_batches is None:
                raise RuntimeError("no evaluation was started (start_held_out)")
            batch = self._in_thread(next, self._held_batches, None)
            if batch is None:
                self._held_batches = None
            return batch
        if self._ahead is None:
            self._read_ahead()
        assert self._ahead is not None
        batch = self._ahead[1].result()
        self._read_ahead()
        return batch

    def _read_ahead(self) -> None:
        feed = self._training()
        self._ahead = (feed.state(), self._thread.submit(self._load, feed))

    def _load(self, feed: data.Feed) -> Batch:
        """The next batch, its inputs on the stage's device (a blocking copy: done when this
        returns, whatever stream the forwards run on)."""
        inputs, labels = feed.batch()
        if self.device.type == "cuda":
            # From page-locked memory the copy runs at the bus's speed: a pageable one of a
            # 224-px batch (154 MB) ran at 2 GB/s on the GPU machine (rpc_transfer.py).
            inputs = batch_values.pinned(inputs)
        return batch_values.to(inputs, self.device), labels

    def _drop_ahead(self) -> None:
        """Forget the batch read ahead, once its reading is over (the feed is not safe to
        touch before); a failed read ahead says nothing here."""
        if self._ahead is not None:
            self._ahead[1].exception()
            self._ahead = None
