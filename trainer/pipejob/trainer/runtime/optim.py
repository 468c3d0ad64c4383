"""The spec's `optimizer` section (both job kinds): the torch.optim class and its arguments,
the learning rate at each optimizer step (`schedule`), and the coefficient that clips the
gradients to `clipGradNorm`."""

from __future__ import annotations

import math
from typing import Any

import torch

from pipejob.core.common import Optimizer

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
}
WITH_MOMENTUM = ("sgd", "rmsprop")
# torch.nn.utils.clip_grad_norm_'s guard against a zero norm; the same here, so a clipped
# step equals torch's to the last bit of the coefficient.
CLIP_EPS = 1e-6


def optimizer_args(opt: Optimizer) -> tuple[type[torch.optim.Optimizer], dict[str, float]]:
    """The torch.optim class and keyword arguments for an `optimizer` section."""
    kwargs = {"lr": opt.lr, "weight_decay": opt.weight_decay}
    if opt.name in WITH_MOMENTUM:
        kwargs["momentum"] = opt.momentum
    return OPTIMIZERS[opt.name], kwargs


def learning_rate(opt: Optimizer, steps: int, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based) of a run of `steps`: linear warmup
    (lr * (step + 1) / warmupSteps, so the first step already learns and step warmupSteps - 1
    reaches lr), then constant, or linear or cosine decay from lr towards minLr, which the
    decay reaches after the last step: progress p = (step - warmup) / (steps - warmup)."""
    schedule = opt.schedule
    if schedule is None:
        return opt.lr
    warmup = schedule.warmup_steps
    if step < warmup:
        return opt.lr * (step + 1) / warmup
    if schedule.decay == "constant" or steps <= warmup:
        return opt.lr
    progress = (step - warmup) / (steps - warmup)
    if schedule.decay == "linear":
        left = 1.0 - progress
    else:  # cosine
        left = 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.min_lr + (opt.lr - schedule.min_lr) * left


def clip_coefficient(norm: float, max_norm: float | None) -> float:
    """What every gradient is multiplied by so that the global norm is at most `max_norm`:
    torch.nn.utils.clip_grad_norm_'s min(1, max_norm / (norm + 1e-6)); 1.0 when unclipped."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (norm + CLIP_EPS))


def set_lr(local: Any, lr: float) -> None:
    """Set the learning rate of a torch.optim optimizer, or of one of DistributedOptimizer's
    local optimizers (on its owner): a `_LocalOptimizer` around a torch.optim one, or a
    TorchScript module whose functional optimizer reads `defaults["lr"]` at every step
    (reading `module.optim` returns a copy: write the updated copy back)."""
    optim = getattr(local, "optim", local)
    if isinstance(optim, torch.optim.Optimizer):
        for group in optim.param_groups:
            group["lr"] = lr
        return
    optim.defaults = {**optim.defaults, "lr": lr}
    local.optim = optim


def set_remote_lr(local: Any, lr: float) -> None:
    """Runs on a local optimizer's owner: `set_lr` of the optimizer an RRef refers to."""
    set_lr(local.local_value(), lr)
