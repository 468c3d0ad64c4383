"""A step on the eager path, on the master: each micro-batch's forward (the user's own, with
the stages' modules called where they live, on its replica's stages) and backward in a
thread of its own, inside its own distributed autograd context, so the micro-batches (of
every replica) overlap across the stages as the seeds' RPC pipeline's do; with
gradientAccumulation, its batches one after the other. Then every process sums its
gradients over the contexts in micro-batch order (the stages then over the replicas), the
master judges the global norm, and every process steps its own. With fp16 each backward
starts from the loss times the loss scale (gradients.LossScale, the traced path's), every
process divides its sums by it, and a step whose gradients overflowed is not applied."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

from pipejob.trainer.pipeline.driver import divergence
from pipejob.trainer.pipeline.eager import remote
from pipejob.trainer.pipeline.eager.held import squared_norm, summed_gradients
from pipejob.trainer.pipeline.gradients import LossScale
from pipejob.trainer.pipeline.stage_base import float32
from pipejob.trainer.runtime import nonfinite
from pipejob.trainer.runtime.optim import Functional, clip_coefficient, set_lr
from pipejob.trainer.workloads import batch_values
from pipejob.trainer.workloads.batch_values import split


@dataclass
class Stages:
    """Per replica, its stage workers and the `Held` of each, in stage order."""

    workers: list[list[str]]
    held: list[list[rpc.RRef]]

    def futures(self, function: Callable[..., Any], *args: Any, replica: int | None) -> list:
        """`function(held, *args)` on every stage of `replica` (None: of every replica,
        replica by replica), as futures."""
        chosen = range(len(self.workers)) if replica is None else [replica]
        return [
            rpc.rpc_async(w, function, args=(h, *args))
            for r in chosen
            for w, h in zip(self.workers[r], self.held[r], strict=True)
        ]

    def on_each(self, function: Callable[..., Any], *args: Any, replica: int | None = 0) -> list:
        """What `function(held, *args)` returns on every stage of `replica` (None: of every
        replica, replica by replica), called at once."""
        return torch.futures.wait_all(self.futures(function, *args, replica=replica))

    def call_async(self, i: int, function: Callable[..., Any], *args: Any, replica: int = 0) -> Any:
        """`function(held, *args)` on `replica`'s stage i, as a future."""
        return rpc.rpc_async(
            self.workers[replica][i], function, args=(self.held[replica][i], *args)
        )

    def divergence(self) -> float:
        """The largest difference of a replica's parameters' fingerprints from replica 0's:
        0.0 while the replicas stay identical, as they must."""
        if len(self.held) == 1:
            return 0.0
        prints = [self.on_each(remote.fingerprint, replica=r) for r in range(len(self.held))]
        return divergence(prints)


class InOrder:
    """The micro-batches' forwards one at a time, in the order of their positions (where a
    module kept with the glue changes Python state the glue reads: DynUNet's heads)."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.next = 0

    @contextmanager
    def turn(self, position: int) -> Iterator[None]:
        with self.changed:
            self.changed.wait_for(lambda: self.next == position)
        try:
            yield
        finally:  # failed or not, the next forward runs
            with self.changed:
                self.next += 1
                self.changed.notify_all()


class MicroBatch(threading.Thread):
    """Micro-batch `number`'s forward and backward in its own context, which it keeps open
    (the stages read their gradients from it) until `release` is set."""

    def __init__(
        self,
        run: Callable[[], torch.Tensor],
        turn: tuple[int, int, int],
        stages: Stages,
        order: tuple[InOrder, int] | None = None,
        scale: float = 1.0,
    ):
        super().__init__(daemon=True, name=f"eager micro-batch {turn[0]} of replica {turn[2]}")
        self.run_forward, self.stages, self.order = run, stages, order
        self.scale = scale  # fp16's loss scale: the backward starts from loss x scale
        self.number, self.first, self.replica = turn
        self.done = threading.Event()
        self.release = threading.Event()
        self.context = -1
        self.loss = math.nan
        self.error: BaseException | None = None

    def _forward(self) -> torch.Tensor:
        if self.order is None:
            return self.run_forward()
        order, position = self.order
        with order.turn(position):
            return self.run_forward()

    def run(self) -> None:
        try:
            with dist_autograd.context() as context:
                self.context = context
                try:
                    remote.begin(self.number, self.first, self.replica)
                    loss = self._forward()
                finally:  # its replica's later micro-batches no longer wait for this one
                    self.stages.futures(remote.ended, self.number, replica=self.replica)
                self.loss = loss.item()
                dist_autograd.backward(context, [loss * self.scale if self.scale != 1.0 else loss])
                self.done.set()
                self.release.wait()
        except BaseException as e:  # the step fails with it, at once
            self.error = e
            self.done.set()


def computed(model: nn.Module, inputs: Any, autocast: torch.dtype | None) -> Any:
    """The model's output on `inputs` as the master computes it: its glue in the job's
    precision (`autocast`, None for the model's own dtypes: one process's forward runs in
    it whole), handed to the loss in float32 as the traced path's last stage hands it."""
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(inputs)
    return out if autocast is None else float32(out)


@dataclass
class Step:
    loss: float
    grad_norm: float
    lr: float
    seconds: float
    skipped: str | None = None  # the line saying a non-finite step was skipped, not applied
    overflowed: bool = False  # fp16's scaled gradients overflowed: not applied, scale halved

    @property
    def applied(self) -> bool:
        return self.skipped is None and not self.overflowed


def step(
    forward: Callable[[Any], Any],
    glue: Functional | None,
    stages: Stages,
    batches: list[tuple[Any, Any]],
    micro_batches: int,
    number: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    rules: tuple[float | None, nonfinite.Guard],
    lr: float,
    one_at_a_time: bool = False,
    scale: LossScale | None = None,
) -> Step:
    """Step `number` (0-based) on `batches` (gradientAccumulation's rounds, one after the
    other), `forward` giving the model's output (`computed`), `rules` the clipping norm and
    what a non-finite step does, `one_at_a_time` whether the forwards run in turn
    (Placement.one_at_a_time), `scale` fp16's loss scale (updated here): the mean of the
    rounds' losses (each micro-batch's weighted by its share of its round), the global
    gradient norm before clipping."""
    start = time.perf_counter()
    threads: list[MicroBatch] = []
    max_norm, guard = rules
    multiplier = 1.0 if scale is None else scale.scale
    try:
        for k, batch in enumerate(batches):
            first = (number * len(batches) + k) * micro_batches
            started = round_threads(
                forward, stages, batch, micro_batches, first, loss_fn, len(batches), multiplier
            )
            if one_at_a_time:  # in the round's order: replica, then micro-batch
                order = InOrder()
                for position, t in enumerate(started):
                    t.order = order, position
            threads += started  # released below, whatever happens
            run_all(started)
        grads, squares = summed(stages, threads, 1.0 / multiplier)
        loss, norm = sum(t.loss for t in threads), math.sqrt(sum(squares))
        # With fp16, gradients that overflowed are the loss scale's to judge, below.
        bad = not_finite(loss, squares if scale is None else [], stages.workers[0])
        if bad is not None:  # the step is not applied: the job stops, or it is skipped
            return Step(loss, norm, lr, time.perf_counter() - start, guard.check(number + 1, *bad))
        if scale is not None and not scale.update(norm):  # overflowed, as GradScaler skips
            return Step(loss, norm, lr, time.perf_counter() - start, overflowed=True)
        coefficient = clip_coefficient(norm, max_norm)
        stages.on_each(remote.step, coefficient, lr, replica=None)
        if glue is not None:
            if coefficient != 1.0:
                for g in grads.values():
                    g.mul_(coefficient)
            set_lr(glue, lr)
            glue.step(grads)
    finally:
        for t in threads:
            t.release.set()
        for t in threads:
            t.join()
    return Step(loss, norm, lr, time.perf_counter() - start)


def not_finite(
    loss: float, squares: list[float], workers: list[str]
) -> tuple[str, float, str] | None:
    """What of a step was not finite, its value and where it came from (nonfinite.Guard's
    words): the loss, else the gradient norm (`squares`: the glue's squared norm, then each
    stage's). The backward runs from the master's loss back through the stages in the
    forward's order: the latest stage whose gradients are not finite is where they became
    so (the glue's, where no stage's is)."""
    if not math.isfinite(loss):
        return "loss", loss, "the model's forward or its loss (the master's, on the eager path)"
    norm = math.sqrt(sum(squares))
    if math.isfinite(norm):
        return None
    stage = max((k for k, s in enumerate(squares[1:]) if not math.isfinite(s)), default=None)
    where = "the master's glue's backward" if stage is None else f"{workers[stage]}'s backward"
    return "gradient norm", norm, where


def round_threads(
    forward: Callable[[Any], Any],
    stages: Stages,
    batch: tuple[Any, Any],
    micro_batches: int,
    first: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    rounds: int,
    scale: float = 1.0,
) -> list[MicroBatch]:
    """One round's micro-batches, each's forward and backward a thread (not yet started):
    each replica's share of `batch` in `micro_batches`, numbered from `first` on each
    replica's stages, each loss weighted by its share of the batch over the step's
    `rounds`, each backward from it times `scale` (fp16's); in replica then micro-batch
    order (the batch's)."""
    inputs, labels = batch
    total = batch_values.samples(labels) * rounds
    replicas = len(stages.held)
    threads = []
    shares = zip(split(inputs, replicas), split(labels, replicas), strict=True)
    for r, (share_x, share_y) in enumerate(shares):
        parts = zip(split(share_x, micro_batches), split(share_y, micro_batches), strict=True)
        for i, (x, y) in enumerate(parts):
            weight = batch_values.samples(y) / total

            def run(x: Any = x, y: Any = y, weight: float = weight) -> torch.Tensor:
                return loss_fn(forward(x), y) * weight

            threads.append(MicroBatch(run, (first + i, first, r), stages, scale=scale))
    return threads


def run_all(threads: list[MicroBatch]) -> None:
    """Start `threads` and wait until each has run its backward (its context kept open)
    or failed: the first failure fails the step."""
    for t in threads:
        t.start()
    for t in threads:
        t.done.wait()
    failed = [t.error for t in threads if t.error is not None]
    if failed:
        raise failed[0]


def summed(
    stages: Stages, threads: list[MicroBatch], unscale: float = 1.0
) -> tuple[dict[torch.Tensor, torch.Tensor], list[float]]:
    """The glue's gradients summed over every micro-batch's context in order (rounds, then
    replicas, then micro-batches: one process's order), the stages' over their replica's
    then over the replicas (replica_sums.py), each sum times `unscale` (1 / fp16's loss
    scale); the squared norms, the glue's then each stage's (replica 0's: every replica's
    are the same)."""
    grads = summed_gradients([t.context for t in threads])
    if unscale != 1.0 and grads:
        torch._foreach_mul_(list(grads.values()), unscale)
    replicas = len(stages.held)
    contexts = [[t.context for t in threads if t.replica == r] for r in range(replicas)]
    futures = [
        f
        for r in range(replicas)
        for f in stages.futures(remote.sum_gradients, contexts[r], unscale, replica=r)
    ]
    return grads, [squared_norm(grads), *torch.futures.wait_all(futures)[: len(stages.held[0])]]
