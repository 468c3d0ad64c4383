"""A HybridJob trainer's dense model without DDP: every trainer starts from DDP rank 0's
weights, and steps on the trainers' average of its gradients, which rides a crossing the step
makes anyway (the servers' calls, or the replicated tables' all-reduce: trainer.py's _step).
docs/architecture.md, "A HybridJob's step"."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters


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
        flat = self.due.to(self.parameters[0].device)
        sizes = [p.numel() for p in self.parameters]
        for p, g in zip(self.parameters, flat.split(sizes), strict=True):
            p.grad = g.view_as(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.due = None
