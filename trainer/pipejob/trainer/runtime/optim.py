"""The spec's `optimizer` section (both job kinds): the torch.optim class and its arguments,
a pipeline stage's optimizer (`Functional`), the learning rate at each optimizer step
(`schedule`), and the coefficient that clips the gradients to `clipGradNorm`."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch.optim import adam, adamw, rmsprop, sgd

from pipejob.core.optimizer import Optimizer
from pipejob.trainer.runtime.param_groups import OptimizerArgs, ParamGroup, param_groups

if TYPE_CHECKING:
    from pipejob.trainer.runtime.checkpoint import OptimizerLike

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
}
WITH_MOMENTUM = ("sgd", "rmsprop")
WITH_BETAS = ("adam", "adamw")
# torch.nn.utils.clip_grad_norm_'s guard against a zero norm; the same here, so a clipped
# step equals torch's to the last bit of the coefficient.
CLIP_EPS = 1e-6


def optimizer_args(opt: Optimizer) -> tuple[type[torch.optim.Optimizer], OptimizerArgs]:
    """The torch.optim class and keyword arguments for an `optimizer` section."""
    kwargs = OptimizerArgs(lr=opt.lr, weight_decay=opt.weight_decay)
    if opt.name in WITH_MOMENTUM:
        kwargs["momentum"] = opt.momentum
    if opt.name in WITH_BETAS:
        kwargs["betas"] = (opt.beta1, opt.beta2)
    return OPTIMIZERS[opt.name], kwargs


def build(opt: Optimizer, named: Iterable[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
    """torch.optim's optimizer `opt.name` over the parameters `named` (name, parameter), in
    spec.optimizer's groups (runtime/param_groups.py): a HybridJob's dense optimizer."""
    cls, kwargs = optimizer_args(opt)
    return cls(param_groups(opt, named, kwargs), **kwargs)


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


class Functional:
    """torch.optim's optimizer `opt.name` over `params`, stepped through torch's functional
    form of it (torch.optim.sgd.sgd, adam.adam, adamw.adamw, rmsprop.rmsprop): the class's
    arithmetic, defaults and state, without building the class, which imports torch._dynamo
    (+150 MB a process) and DistributedOptimizer torch.distributed.optim (+50 MB: sympy,
    FSDP). `param_groups` and `state` are torch.optim's, so learning rates and checkpoints
    treat it as one. Always the multi-tensor form (torch's default only on GPUs): on a CPU it
    gives the single-tensor form's values to the bit, in a loop in C++ rather than Python."""

    def __init__(self, opt: Optimizer, named: Iterable[tuple[str, torch.Tensor]]):
        """`named`: the parameters by their names in the whole model (which the groups of
        spec.optimizer.groups match)."""
        self.name = opt.name
        _, kwargs = optimizer_args(opt)
        self.param_groups = param_groups(opt, named, kwargs)
        self.state: defaultdict[torch.Tensor, dict[str, torch.Tensor]] = defaultdict(dict)

    def step(self, grads: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Step every parameter with a gradient: its `grads` entry (the rpc engine's, from
        the step's distributed autograd context), or its `.grad`; group by group, each with
        its own settings (a parameter's arithmetic is its own: the grouping changes no bit)."""
        # Named in a profile's trace, as torch.optim's step is.
        with torch.no_grad(), torch.profiler.record_function(f"optimizer step ({self.name})"):
            for group in self.param_groups:
                found = {p: p.grad if grads is None else grads.get(p) for p in group["params"]}
                params = [p for p, g in found.items() if g is not None]
                if params:
                    _STEPS[self.name](self, group, params, [found[p] for p in params])

    def zero_grad(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def _steps(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters' step counters, made as torch.optim makes them (on the CPU)."""
        for p in params:
            self.state[p].setdefault("step", torch.tensor(0.0, dtype=_scalar_dtype()))
        return [self.state[p]["step"] for p in params]

    def _zeros(self, params: list[torch.Tensor], key: str) -> list[torch.Tensor]:
        for p in params:
            if key not in self.state[p]:
                self.state[p][key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return [self.state[p][key] for p in params]


Tensors = list[torch.Tensor]


def _sgd(o: Functional, group: ParamGroup, params: Tensors, grads: Tensors) -> None:
    momentum = group["momentum"]
    buffers = [o.state[p].get("momentum_buffer") for p in params]
    sgd.sgd(
        params,
        grads,
        buffers,
        weight_decay=group["weight_decay"],
        momentum=momentum,
        lr=group["lr"],
        dampening=0.0,
        nesterov=False,
        maximize=False,
        foreach=True,
    )
    if momentum != 0:  # the functional form makes a buffer where there was none
        for p, buffer in zip(params, buffers, strict=True):
            o.state[p]["momentum_buffer"] = buffer


def _adam(o: Functional, group: ParamGroup, params: Tensors, grads: Tensors) -> None:
    step = adamw.adamw if o.name == "adamw" else adam.adam
    steps = o._steps(params)
    step(
        params,
        grads,
        o._zeros(params, "exp_avg"),
        o._zeros(params, "exp_avg_sq"),
        [],
        steps,
        has_complex=any(torch.is_complex(p) for p in params),
        amsgrad=False,
        beta1=group["betas"][0],
        beta2=group["betas"][1],
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=1e-8,
        maximize=False,
        foreach=True,
    )


def _rmsprop(o: Functional, group: ParamGroup, params: Tensors, grads: Tensors) -> None:
    momentum = group["momentum"]
    steps = o._steps(params)
    buffers = o._zeros(params, "momentum_buffer") if momentum > 0 else []
    rmsprop.rmsprop(
        params,
        grads,
        o._zeros(params, "square_avg"),
        [],
        buffers,
        steps,
        has_complex=any(torch.is_complex(p) for p in params),
        lr=group["lr"],
        alpha=0.99,
        eps=1e-8,
        weight_decay=group["weight_decay"],
        momentum=momentum,
        centered=False,
        foreach=True,
    )


_STEPS = {"sgd": _sgd, "adam": _adam, "adamw": _adam, "rmsprop": _rmsprop}


def _scalar_dtype() -> torch.dtype:
    # torch.optim's: float64 counters where float64 is the default dtype.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def set_lr(optim: OptimizerLike, lr: float) -> None:
    """Set the learning rate of a torch.optim optimizer or a `Functional` one: `lr` times
    each group's lr_scale (spec.optimizer.groups, layerDecay)."""
    for group in optim.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
