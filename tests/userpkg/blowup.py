"""A user's model that goes non-finite at a chosen step: a layer that passes its input on,
but in the training forwards of step `at` (it counts its own training forwards,
`micro_batches` a step) gives NaN, or, `backward`, passes NaN gradients back; in whichever
process computes it; evaluation is left alone, unless `held_out`: then every evaluation
forward gives NaN. What `test_nonfinite.py` brings with
`import:` to see a run that goes non-finite stop."""

from __future__ import annotations

import torch
from torch import nn

from userpkg.vision import small_cnn


class NanGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class Blowup(nn.Module):
    def __init__(self, at: int, micro_batches: int, backward: bool = False, held_out: bool = False):
        super().__init__()
        self.at, self.micro_batches, self.backward = at, micro_batches, backward
        self.held_out = held_out
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x * float("nan") if self.held_out else x
        self.forwards += 1
        if (self.forwards - 1) // self.micro_batches + 1 != self.at:
            return x
        return NanGradient.apply(x) if self.backward else x * float("nan")


def cnn(at: int, micro_batches: int, backward: bool = False, classes: int = 10) -> nn.Module:
    """userpkg.vision's small CNN with a Blowup after its convolutions (module 6)."""
    layers = list(small_cnn(classes=classes))
    return nn.Sequential(*layers[:6], Blowup(at, micro_batches, backward), *layers[6:])


def dense(at: int, dim: int, classes: int, held_out: bool = False) -> nn.Module:
    """A HybridJob's dense model that gives NaN in step `at` (one forward a step), or in
    every evaluation (`held_out`)."""
    return nn.Sequential(nn.Linear(dim, classes), Blowup(at, 1, held_out=held_out))


class ScaledBlowup(Blowup):
    """A Blowup that holds a parameter of its own (a scale, 1.0), so that the eager path
    places it on a stage: there it counts only the step's training forwards (the master's
    own model also runs the forwards that place and check the model)."""

    def __init__(self, at: int, micro_batches: int, backward: bool = False):
        super().__init__(at, micro_batches, backward)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def eager_cnn(at: int, micro_batches: int, backward: bool = False) -> nn.Module:
    """`cnn` with its Blowup on a stage of the eager path (ScaledBlowup)."""
    layers = list(small_cnn(classes=10))
    return nn.Sequential(*layers[:6], ScaledBlowup(at, micro_batches, backward), *layers[6:])
