"""A HybridJob trainer's dense model without DDP: every trainer starts from DDP rank 0's
weights, and steps on the trainers' average of its gradients, which rides a crossing the step
makes anyway (the servers' calls, or the replicated tables' all-reduce: trainer.py's _step).
docs/architecture.md, "A HybridJob's step"."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.optim.adam import adam

MOMENTS = ("exp_avg", "exp_avg_sq")


def broadcast_weights(module: nn.Module) -> None:
    """Give every trainer DDP rank 0's weights (one broadcast, as DDP's start does): a module
    that draws its own weights still starts alike everywhere."""
    flat = parameters_to_vector(module.parameters()).detach()
    dist.broadcast(flat, 0)
    vector_to_parameters(flat, module.parameters())


def kept_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The module's buffers in its state (DLRM's pair indices, made alike on every rank, are
    not): rank 0's are broadcast before each forward, as DDP does."""
    kept = module.state_dict().keys()
    return [b for name, b in module.named_buffers() if name in kept]


class DenseStep:
    """The dense model's optimizer step on a step's gradients averaged over the trainers (by
    the servers in the next step's calls, or in the replicated tables' all-reduce), taken
    before the next dense forward."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer):
        self.parameters = list(module.parameters())
        self.optimizer = optimizer
        self.due: torch.Tensor | None = None
        self.flat = FlatAdam.of(optimizer, self.parameters)

    def gradients(self) -> torch.Tensor:
        """This trainer's gradients of the dense model, flat (zeros for a parameter the
        step left without one)."""
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.parameters]
        flat = torch.cat([g.reshape(-1) for g in grads])
        for p in self.parameters:
            p.grad = None
        return flat

    def defer(self, averaged: torch.Tensor | None) -> None:
        """The trainers' average of `gradients`, to step by (None: none came)."""
        if averaged is not None:
            self.due = averaged

    def flush(self) -> None:
        """Take the deferred step, if any: before the dense forward, a checkpoint, the end."""
        if self.due is None:
            return
        if self.flat is not None:
            self.flat.step(self.due)
            self.due = None
            return
        flat = self.due.to(self.parameters[0].device)
        sizes = [p.numel() for p in self.parameters]
        for p, g in zip(self.parameters, flat.split(sizes), strict=True):
            p.grad = g.view_as(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.due = None


class FlatAdam:
    """torch.optim.Adam's (or AdamW's) step of CPU parameters in one group, taken on them
    joined into one tensor: torch's own single-tensor arithmetic, element by element the
    same (the same bits: tests/test_recsys.py), in seven ops a step instead of seven a
    parameter (per-op costs dominate a DLRM's few small layers). Its moments are kept joined;
    the optimizer's state holds views of them under each parameter, as a checkpoint saves
    and loads it."""

    def __init__(self, optimizer: torch.optim.Adam, parameters: list[nn.Parameter]):
        self.group, self.parameters = optimizer.param_groups[0], parameters
        self.sizes = [p.numel() for p in parameters]
        state = [optimizer.state.get(p, {}) for p in parameters]
        if all(state):  # loaded from a checkpoint
            self.moments = [torch.cat([s[k].reshape(-1) for s in state]) for k in MOMENTS]
            self.count = state[0]["step"].clone()
        else:
            first = parameters_to_vector(parameters).detach()
            self.moments = [torch.zeros_like(first) for _ in MOMENTS]
            # As torch's Adam counts: on the CPU, in float64 where that is the default.
            wide = torch.get_default_dtype() == torch.float64
            self.count = torch.tensor(0.0, dtype=torch.float64 if wide else torch.float32)
        split = [m.split(self.sizes) for m in self.moments]
        for k, p in enumerate(parameters):
            views = {key: pieces[k].view_as(p) for key, pieces in zip(MOMENTS, split, strict=True)}
            optimizer.state[p] = {"step": self.count, **views}

    @classmethod
    def of(
        cls, optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter]
    ) -> FlatAdam | None:
        """The joined step for `optimizer`, or None where it would not be the same as the
        optimizer's own (not Adam, several groups, amsgrad, maximize, a GPU, mixed dtypes)."""
        groups = optimizer.param_groups
        if not isinstance(optimizer, torch.optim.Adam) or len(groups) != 1 or not parameters:
            return None
        group = groups[0]
        plain = not any(
            group.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable", "fused")
        )
        alike = {(p.device.type, p.dtype) for p in parameters} == {("cpu", parameters[0].dtype)}
        floating = parameters[0].is_floating_point() and not parameters[0].is_complex()
        stated = {bool(optimizer.state.get(p)) for p in parameters}  # all or none
        if plain and alike and floating and len(stated) == 1:
            return cls(optimizer, parameters)
        return None

    @torch.no_grad()
    def step(self, gradient: torch.Tensor) -> None:
        """Step the parameters by `gradient`, flat, in their order."""
        joined = parameters_to_vector(self.parameters)
        g = self.group
        adam(
            [joined],
            [gradient.to(joined.dtype)],
            *([m] for m in self.moments),
            [],
            [self.count],
            foreach=False,
            decoupled_weight_decay=g["decoupled_weight_decay"],
            amsgrad=False,
            beta1=g["betas"][0],
            beta2=g["betas"][1],
            lr=g["lr"],
            weight_decay=g["weight_decay"],
            eps=g["eps"],
            maximize=False,
        )
        for p, stepped in zip(self.parameters, joined.split(self.sizes), strict=True):
            p.copy_(stepped.view_as(p))
