"""A refused row's check on the eager path (trainer/pipejob/trainer/pipeline/eager/), in one
process, in the row's dtype: the placement the eager path makes (modules by measured cost,
checked through copies), then each stage's modules taken from a build of their own under the
seed (as a stage builds them) and called through copies of their inputs and outputs (autograd
kept, as distributed autograd keeps it), against the plain model:

(a) every placed module's parameters and buffers equal the plain build's, bit for bit;
(b) the outputs, micro-batch by micro-batch, equal the plain model's bit for bit, in training
    mode (the same seed) and in evaluation mode;
(c) one step's loss and gradients (every parameter: the glue's and each stage's, by the
    model's names) equal the plain model's within the row's tolerance."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from _conform import SEED, TOLERANCE, Failed, _generic_loss, _leaves, _micro
from torch import nn
from torch.utils._pytree import tree_map_only

from pipejob.trainer.pipeline.eager.check import check
from pipejob.trainer.pipeline.eager.placement import (
    Placement,
    aliases,
    no_grad_run,
    place,
    replace,
)

STAGES = 2


class _Copying(nn.Module):
    """`module` (a stage's), called with clones of its inputs, giving clones of its outputs."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.held = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        clone = lambda v: tree_map_only(torch.Tensor, lambda t: t.clone(), v)  # noqa: E731
        return clone(self.held(*clone(args), **clone(kwargs)))


def check_eager(build: Callable[[], nn.Module], x: Any) -> str:
    """The eager path's placement of the model, checked (a) to (c); its stages' modules."""
    plain, model, stages_build = build(), build(), build()
    run, other = (no_grad_run(model, part) for part in _micro(x)[:2])
    placement = check(model, run, lambda kept: place(model, run, STAGES, kept), other)
    _placed(model, stages_build, placement)
    plain_state = plain.state_dict()
    for name in placement.remote():
        for key, value in stages_build.get_submodule(name).state_dict().items():
            if not torch.equal(value, plain_state[f"{name}.{key}"]):
                raise Failed(f"(a) eager: {name}.{key} differs from the plain build's")
    for training in (True, False):
        with torch.no_grad():
            got, expected = _outputs(model, x, training), _outputs(plain, x, training)
        for i, (u, v) in enumerate(zip(_leaves(got), _leaves(expected), strict=True)):
            if u.shape != v.shape or not torch.equal(u, v):
                mode = "training" if training else "evaluation"
                raise Failed(f"(b) eager: output {i} in {mode} differs")
    _same_gradients(plain, model, stages_build, placement, x)
    return " | ".join(", ".join(names) for names in placement.stages)


def _placed(model: nn.Module, stages_build: nn.Module, placement: Placement) -> None:
    """The placed modules of `model` replaced by the stages' (from a build of their own)."""
    for name in placement.remote():  # under every name it has, as the eager path does
        replace(model, name, _Copying(stages_build.get_submodule(name)))


def _outputs(model: nn.Module, x: Any, training: bool) -> Any:
    torch.manual_seed(SEED + 1)
    model.train(training)  # as the user's config says (the eager path keeps any cache)
    return [model(part) for part in _micro(x)]  # per micro-batch: a cache does not join


def _same_gradients(
    plain: nn.Module, model: nn.Module, stages_build: nn.Module, placement: Placement, x: Any
) -> None:
    """(c) The loss and every gradient, by the model's names."""
    x_loss = {}
    for m in (plain, model, stages_build):
        m.zero_grad(set_to_none=True)
    for key, m in (("got", model), ("expected", plain)):
        loss = sum(_generic_loss(out) for out in _outputs(m, x, True))
        loss.backward()
        x_loss[key] = loss.item()
    bound = TOLERANCE[torch.get_default_dtype()]
    if abs(x_loss["got"] - x_loss["expected"]) > bound * max(abs(x_loss["expected"]), 1e-30):
        raise Failed(
            f"(c) eager: the loss is {x_loss['got']!r}, one process's {x_loss['expected']!r}"
        )
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    for name in placement.remote():  # one module's gradient, under each of its names
        module = stages_build.get_submodule(name)
        for alias in aliases(plain, name):
            named = module.named_parameters(remove_duplicate=False)
            grads |= {f"{alias}.{n}": p.grad for n, p in named}
    for name, p in plain.named_parameters(remove_duplicate=False):
        expected, got = p.grad, grads.get(name)
        if expected is None or not expected.any():
            continue
        if got is None:
            raise Failed(f"(c) eager: {name} got no gradient")
        scale = expected.abs().max().item()
        if (got - expected).abs().max().item() > bound * scale:
            raise Failed(f"(c) eager: {name}'s gradient is off (its scale {scale:.3g})")
