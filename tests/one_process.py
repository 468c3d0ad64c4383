"""A job's first step in one plain process, and a finished job's output held against it: the
step-1 loss, and every parameter after one SGD step (so every gradient, scaled by the
learning rate) and every persistent buffer (BatchNorm's statistics), within a tolerance
that the caller gives for the dtype. The micro-batches run one at a time, each loss weighed
by its samples, as the guide says a pipeline's step weighs them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pipejob.core import spec
from pipejob.trainer import workloads
from pipejob.trainer.runtime import model_files
from pipejob.trainer.workloads import batch_values, data, models


@dataclass
class Step:
    loss: float
    before: dict[str, torch.Tensor]  # the state dict as built
    after: dict[str, torch.Tensor]  # after the step: parameters less lr x gradient
    grads: dict[str, torch.Tensor]  # zero where the parameter got none (frozen, unused)


def first_step(manifest: dict[str, Any], lr: float) -> Step:
    """Step 1 of the job in one process: its loss, and its state before and after one SGD
    step (no momentum) of `lr`."""
    s = spec.parse(manifest).settings
    model = models.build(s)
    before = {n: v.detach().clone() for n, v in model.state_dict().items()}
    with data.Feed(s) as feed:
        inputs, labels = feed.batch()
    m, loss_fn = s.micro_batches, workloads.loss(s)
    total = batch_values.samples(labels)
    loss = sum(
        loss_fn(model(x), y) * (batch_values.samples(y) / total)
        for x, y in zip(batch_values.split(inputs, m), batch_values.split(labels, m), strict=True)
    )
    loss.backward()
    grads, after = {}, {n: v.detach().clone() for n, v in model.state_dict().items()}
    for name, p in model.named_parameters(remove_duplicate=False):  # a shared weight's names
        grads[name] = torch.zeros_like(p) if p.grad is None else p.grad.detach()
        after[name] = (p - lr * grads[name]).detach()
    return Step(loss.item(), before, after, grads)


def assert_output_is_the_step(
    out: Path, summary: dict[str, Any], step: Step, lr: float, tolerance: float
) -> None:
    """The job's step-1 loss and its output (loaded as a user loads it) equal `step`'s: each
    parameter within `lr x tolerance x` its gradient's scale (the pipeline's gradient error)
    plus a few ulps of the weight (the update's own rounding), each buffer within
    `tolerance` of its scale; the same names, nothing missing, nothing more."""
    assert summary["losses"][0] == pytest.approx(step.loss, rel=tolerance), summary["losses"]
    trained = model_files.load_state_dict(out)
    assert sorted(trained) == sorted(step.after), set(trained) ^ set(step.after)
    ulp = torch.finfo(next(iter(step.after.values())).dtype).eps
    for name, expected in step.after.items():
        got = trained[name].to(expected.dtype)
        if not expected.is_floating_point():
            assert torch.equal(got, expected), name
            continue
        grad = step.grads.get(name)
        scale = expected.abs().max().item()
        bound = 4 * ulp * scale + (
            lr * tolerance * grad.abs().max().item() if grad is not None else tolerance * scale
        )
        error = (got - expected).abs().max().item()
        assert error <= bound, f"{name}: off by {error:.3g}, over {bound:.3g}"
