"""A stage's gradients of one round on the rpc engine, added by the stage itself in a fixed
order rather than by distributed autograd as they arrive.

Distributed autograd adds every micro-batch's gradient for a parameter into the parameter's
one accumulator as each arrives; a node's hooks run before its gradients are added there, so
no hook can tell when a micro-batch's last addition is done, and floating-point addition is
not associative: two runs of one manifest drifted in their last bits. Here each node that
hands a gradient to a parameter gives it to the stage instead (`walk_backward`), and
`RoundGradients` adds them in micro-batch order: those that come early wait until the
micro-batches before them are done. Within a micro-batch its nodes run on one thread in the
order they were made, which is the same in every run."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd


def current_context() -> int | None:
    """The distributed autograd context this thread computes in (None: none)."""
    try:
        return dist_autograd._current_context()._context_id()
    except RuntimeError:  # "Current thread doesn't have a valid autograd context"
        return None


class RoundGradients:
    """The sum of one training round's gradients on a stage, by parameter name: micro-batch
    0's, then 1's and so on (`in_order`), or in the order they come where that order is the
    same in every run (the last stage's one backward). A sum of two or more is made in
    `buffers`: the stage's own tensors for this round, reused from step to step (allocating
    them anew would fault in fresh pages every step)."""

    def __init__(self, step: int, round: int, in_order: bool, buffers: dict[str, torch.Tensor]):
        self.step, self.round, self.in_order = step, round, in_order
        self._buffers = buffers
        self.total: dict[str, torch.Tensor] = {}
        self._owned: set[str] = set()  # totals this sum made (others are autograd's tensors)
        self._lock = threading.Lock()
        self._next = 0  # the micro-batch whose gradients are added as they come
        self._held: dict[int, list[tuple[str, torch.Tensor]]] = defaultdict(list)
        self._done: set[int] = set()

    def add(self, micro_batch: int, name: str, grad: torch.Tensor) -> None:
        """A gradient of parameter `name` from micro-batch `micro_batch`'s backward."""
        with self._lock:
            if self.in_order and micro_batch != self._next:
                self._held[micro_batch].append((name, grad))
            else:
                self._add(name, grad)

    def done(self, micro_batch: int) -> None:
        """Micro-batch `micro_batch`'s backward has handed over all its gradients here."""
        with self._lock:
            self._done.add(micro_batch)
            while self._next in self._done:
                self._next += 1
                for name, grad in self._held.pop(self._next, []):
                    self._add(name, grad)

    def _add(self, name: str, grad: torch.Tensor) -> None:
        if name not in self.total:
            self.total[name] = grad
        elif name in self._owned:
            self.total[name].add_(grad)
        else:  # the first gradient may be another node's input too: never changed in place
            self.total[name] = torch.add(self.total[name], grad, out=self._buffer(name, grad))
            self._owned.add(name)

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The stage's tensor for `name`'s sum, made on first use (or if `like` changed)."""
        kept = self._buffers.get(name)
        if kept is None or (kept.shape, kept.dtype, kept.device) != (
            like.shape,
            like.dtype,
            like.device,
        ):
            kept = self._buffers[name] = torch.empty_like(like)
        return kept

    def merged(self, arrived: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The total with gradients distributed autograd added itself (`arrived`: of nodes
        this stage's graph walk did not reach, if any) added once; the same dict on every
        call, so a change made in place holds for the step."""
        with self._lock:
            for name, grad in arrived.items():
                self._add(name, grad)
            arrived.clear()
            for name in self.total.keys() - self._owned:  # to be changed in place, unshared
                grad = self.total[name]
                self.total[name] = self._buffer(name, grad).copy_(grad)
                self._owned.add(name)
        return self.total


def walk_backward(
    roots: list[Any],
    stops: set[Any],
    names: dict[int, str],
    take: Callable[[str, torch.Tensor], None] | None,
) -> list[Any]:
    """Walk a micro-batch's backward through this stage, from `roots` to its inputs (not past
    the `stops` that send gradients on to the stage before). Each node that hands a gradient
    to a parameter named in `names` (by its tensor's id) gives it to `take` instead (in the
    node's hook, which runs before the node's later nodes do). Returns the nodes nearest the
    inputs: those with no further node of the stage behind them, whose hooks mark the end."""
    ends, seen, todo = [], set(roots), list(roots)
    while todo:
        node = todo.pop()
        taken, inner = [], []
        for i, (f, _) in enumerate(node.next_functions):
            if f is None or f in stops:
                continue
            if type(f).__name__ != "AccumulateGrad":
                inner.append(f)
            elif id(f.variable) in names:
                taken.append((i, names[id(f.variable)]))
        if taken and take is not None:
            node.register_hook(_taker(taken, take))
        if not inner:
            ends.append(node)
        for f in inner:
            if f not in seen:
                seen.add(f)
                todo.append(f)
    return ends


def _taker(taken: list[tuple[int, str]], take: Callable[[str, torch.Tensor], None]):
    """A node's hook: its gradients at positions `taken` go to `take`, none to autograd."""

    def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        out = list(grad_inputs)
        for i, name in taken:
            if out[i] is not None:
                take(name, out[i])
                out[i] = None
        return tuple(out)

    return hook
