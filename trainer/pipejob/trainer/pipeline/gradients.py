"""A step's gradients between the backward and the optimizer's step, across every stage: the
global L2 norm, clipping to `optimizer.clipGradNorm`, fp16's loss scale, and the sum of
gradientAccumulation's rounds. Where each stage's gradients are and how the norm crosses:
docs/architecture.md, "A PipelineJob's step across its stages"."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed.rpc as rpc

from pipejob.trainer.pipeline.stage_calls import StageRef, held
from pipejob.trainer.runtime.optim import clip_coefficient

T = TypeVar("T")


def _settled(function: Callable[..., T]) -> Callable[..., T]:
    """A function run on a stage over RPC, with the stage's device settled before and after
    (Stage.settled): the gradients come from the backward on the stage's stream, and
    the optimizer's step, on an RPC thread's, reads what it leaves."""

    @functools.wraps(function)
    def settled(key: int, *args: Any) -> T:
        with held(key).settled():
            return function(key, *args)

    return settled


def _gradients(key: int, context_id: int) -> dict[str, torch.Tensor]:
    """The gradients in a step of the stage held here by `key`, by parameter name."""
    return held(key).gradients(context_id)


def unscaled_norm(
    grads: dict[str, torch.Tensor], unscale: float = 1.0, leave_out: frozenset[str] = frozenset()
) -> float:
    """Runs on a stage, where its gradients `grads` are: divide them by fp16's loss scale
    (`unscale` is 1 / scale; 1.0 without one) and return their L2 norm, one float64 scalar
    (inf or nan when any is), leaving out the parameters `leave_out` names (copies another
    stage counts). The per-parameter norms are torch's multi-tensor ones, as
    clip_grad_norm_'s (on a GPU a few kernels, not one each); only their norm crosses."""
    if unscale != 1.0 and grads:
        torch._foreach_mul_(list(grads.values()), unscale)
    counted = [g for n, g in grads.items() if n not in leave_out]
    if not counted:
        return 0.0
    norms = torch.stack(torch._foreach_norm(counted, 2)).cpu()
    return torch.linalg.vector_norm(norms.double(), 2).item()


def scale(grads: dict[str, torch.Tensor], coefficient: float) -> None:
    """Runs on a stage: multiply its gradients by the clipping coefficient (1.0: nothing)."""
    if coefficient < 1.0 and grads:
        torch._foreach_mul_(list(grads.values()), coefficient)


# Per stage (its Stage object's id): the gradients of a step's earlier rounds.
_held: dict[int, dict[str, torch.Tensor]] = {}
_held_lock = threading.Lock()


@_settled
def hold_stage(key: int, context_id: int) -> None:
    """Runs on a stage (held here by `key`): add a round's gradients to those it holds for
    the step."""
    with _held_lock:
        kept = _held.setdefault(id(held(key)), {})
    for name, g in _gradients(key, context_id).items():
        if name in kept:
            kept[name].add_(g)
        else:
            kept[name] = g.clone()


@_settled
def release_stage(key: int, context_id: int) -> None:
    """Runs on a stage (held here by `key`): add what it holds to the last round's
    gradients, in that context."""
    with _held_lock:
        kept = _held.pop(id(held(key)), {})
    grads = _gradients(key, context_id)
    for name, g in kept.items():
        if name not in grads:
            raise RuntimeError(
                f"{name} got a gradient in an earlier batch of the step but not in its last:"
                " gradientAccumulation needs every batch to reach the same parameters"
            )
        grads[name].add_(g)


def hold(stages: list[StageRef], context_id: int) -> None:
    """Every stage of `stages` holds a round's gradients for its step (`hold_stage`)."""
    _on_every(stages, hold_stage, context_id)


def release(stages: list[StageRef], context_id: int) -> None:
    """Every stage of `stages` adds what it holds to the last round's (`release_stage`)."""
    _on_every(stages, release_stage, context_id)


def _on_every(stages: list[StageRef], function: Callable[..., Any], *args: Any) -> list[Any]:
    """Call `function(key, *args)` on every stage's worker at once, with its key; their
    results."""
    return torch.futures.wait_all(
        [rpc.rpc_async(stage.name, function, args=(stage.key, *args)) for stage in stages]
    )


def copies(tied: list[list[tuple[int, str]]]) -> dict[int, frozenset[str]]:
    """Per stage index, the tied parameters whose gradient another stage's copy counts (every
    copy of a group but the first)."""
    out: dict[int, set[str]] = {}
    for group in tied:
        for k, name in group[1:]:
            out.setdefault(k, set()).add(name)
    return {k: frozenset(v) for k, v in out.items()}


def total_norm(norms: list[float]) -> float:
    """The global L2 norm over every parameter of every stage, from the stages' norms
    (`unscaled_norm`): inf or nan when any is."""
    return torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float64), 2).item()


def judged_here(loss: float, norms: list[float], clip: float | None) -> tuple[float, bool]:
    """A step judged on a stage that finishes it itself, as the master judges it
    (ReplicasBase.judge): its clipping coefficient, and whether it is applied (its loss and
    global norm finite), from the loss and every stage's norm."""
    total = total_norm(norms)
    return clip_coefficient(total, clip), math.isfinite(loss) and math.isfinite(total)


@dataclass
class LossScale:
    """fp16's dynamic loss scale, as torch.amp.GradScaler keeps it: the loss is multiplied by
    `scale` before the backward so small gradients stay representable in fp16, and the
    gradients divided by it before clipping and the step. A step whose gradients overflowed
    (a non-finite norm) is skipped and the scale halved; after `interval` good steps in a
    row it doubles."""

    scale: float = 2.0**16
    interval: int = 2000
    good: int = 0

    def update(self, norm: float) -> bool:
        """After a step's backward: whether its gradients are finite (the step may go on)."""
        if not math.isfinite(norm):
            self.scale, self.good = self.scale * 0.5, 0
            return False
        self.good += 1
        if self.good >= self.interval:
            self.scale, self.good = self.scale * 2.0, 0
        return True

    def state(self) -> dict[str, float]:
        return {"scale": self.scale, "good": self.good}

    def load(self, state: dict[str, float]) -> None:
        self.scale, self.good = float(state["scale"]), int(state["good"])
