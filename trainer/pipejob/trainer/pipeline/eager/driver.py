"""A step on the eager path, on the master: each micro-batch's forward (the user's own, with
the stages' modules called where they live) and backward in a thread of its own, inside its
own distributed autograd context, so the micro-batches overlap across the stages as the
seeds' RPC pipeline's do; then every process sums its gradients over the contexts in
micro-batch order, the master judges the global norm, and every process steps its own."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.utils._pytree import tree_map_only

from pipejob.trainer.pipeline.eager import remote
from pipejob.trainer.pipeline.eager.held import squared_norm, summed_gradients
from pipejob.trainer.runtime.optim import Functional, clip_coefficient, set_lr


@dataclass
class Stages:
    """The stage workers and the `Held` of each, in order."""

    workers: list[str]
    held: list[rpc.RRef]

    def on_each(self, function: Callable[..., Any], *args: Any) -> list[Any]:
        futures = [
            rpc.rpc_async(w, function, args=(h, *args))
            for w, h in zip(self.workers, self.held, strict=True)
        ]
        return torch.futures.wait_all(futures)

    def call_async(self, i: int, function: Callable[..., Any], *args: Any) -> Any:
        """`function(held, *args)` on stage i, as a future."""
        return rpc.rpc_async(self.workers[i], function, args=(self.held[i], *args))


def split(value: Any, parts: int) -> list[Any]:
    """`value` (a tensor, or tuples, lists and dicts of them) in `parts` micro-batches along
    the batch dimension."""
    if isinstance(value, torch.Tensor):
        return list(value.tensor_split(parts))
    if isinstance(value, dict):
        pieces = {k: split(v, parts) for k, v in value.items()}
        return [{k: v[i] for k, v in pieces.items()} for i in range(parts)]
    if isinstance(value, list | tuple):
        pieces_ = [split(v, parts) for v in value]
        return [type(value)(p[i] for p in pieces_) for i in range(parts)]
    return [value] * parts


def batch_size(value: Any) -> int:
    leaves: list[int] = []
    tree_map_only(torch.Tensor, lambda t: leaves.append(t.shape[0]), value)
    return leaves[0]


class MicroBatch(threading.Thread):
    """Micro-batch `number`'s forward and backward in its own context, which it keeps open
    (the stages read their gradients from it) until `release` is set."""

    def __init__(self, run: Callable[[], torch.Tensor], number: int, first: int, stages: Stages):
        super().__init__(daemon=True, name=f"eager micro-batch {number}")
        self.run_forward, self.number, self.first, self.stages = run, number, first, stages
        self.done = threading.Event()
        self.release = threading.Event()
        self.context = -1
        self.loss = math.nan
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with dist_autograd.context() as context:
                self.context = context
                try:
                    remote.begin(self.number, self.first)
                    loss = self.run_forward()
                finally:  # the stages' later micro-batches no longer wait for this one
                    for w, h in zip(self.stages.workers, self.stages.held, strict=True):
                        rpc.rpc_async(w, remote.ended, args=(h, self.number))
                self.loss = loss.item()
                dist_autograd.backward(context, [loss])
                self.done.set()
                self.release.wait()
        except BaseException as e:  # the step fails with it, at once
            self.error = e
            self.done.set()


@dataclass
class Step:
    loss: float
    grad_norm: float
    lr: float
    seconds: float


def step(
    model: nn.Module,
    glue: Functional | None,
    stages: Stages,
    batch: tuple[Any, Any],
    micro_batches: int,
    number: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    max_norm: float | None,
    lr: float,
) -> Step:
    """Step `number` (0-based) on `batch`: the loss of the whole batch (each micro-batch's
    weighted by its share), the global gradient norm before clipping."""
    start = time.perf_counter()
    inputs, labels = batch
    total = batch_size(labels)
    first = number * micro_batches
    threads = []
    for i, (x, y) in enumerate(
        zip(split(inputs, micro_batches), split(labels, micro_batches), strict=True)
    ):
        share = batch_size(y) / total

        def run(x: Any = x, y: Any = y, share: float = share) -> torch.Tensor:
            return loss_fn(model(x), y) * share

        threads.append(MicroBatch(run, first + i, first, stages))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.done.wait()
        failed = [t.error for t in threads if t.error is not None]
        if failed:
            raise failed[0]
        contexts = [t.context for t in threads]
        grads = summed_gradients(contexts)
        norm = math.sqrt(squared_norm(grads) + sum(stages.on_each(remote.sum_gradients, contexts)))
        coefficient = clip_coefficient(norm, max_norm)
        loss = sum(t.loss for t in threads)
        if not math.isfinite(loss) or not math.isfinite(norm):
            raise FloatingPointError(
                f"step {number + 1}: the loss ({loss}) or the gradients' norm ({norm}) is not"
                " finite; the step is not applied"
            )
        stages.on_each(remote.step, coefficient, lr)
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
