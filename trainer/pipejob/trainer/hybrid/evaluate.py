"""A HybridJob trainer's checks and evaluation around its loop: that the dense module fits
the bags' embeddings and the labels (before the first step, so a misfit fails at once,
saying both shapes), and the loss and accuracy on held-out bags (spec.eval).

Evaluation runs on DDP rank 0, not on the master: rank 0 holds the live dense replica (the
master sees the dense weights only in the trainers' final results) and looks bags up on the
ps directly. The other trainers wait at a barrier meanwhile, so nobody steps the table and
the figures are exactly those of the model after that step. Its lookups
(`ps.held_out_lookup`) run without gradient and outside any dist-autograd context: they
never train the table."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.trainer import workloads
from pipejob.trainer.hybrid.ps import held_out_lookup
from pipejob.trainer.workloads.synthetic import Batch


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return str(tuple(shape)) if shape is not None else f"a {type(value).__name__}"


def check_dense(spec: HybridSpec, dense: nn.Module, loss_fn: workloads.Loss, sample: Batch,
                device: torch.device) -> None:  # fmt: skip
    """Run `dense` on zeros shaped like the bags' embeddings, and the loss on its output with
    a real batch's labels; a failure is a ValueError naming the field and both shapes. In
    eval mode and without gradient: the check changes no weight and no running statistic."""
    field = "spec.dense.import" if spec.dense.import_ else "spec.dense.outFeatures"
    if spec.loss.import_:
        field += " (with spec.loss.import)"
    dim, labels = spec.embedding.dim, torch.tensor(sample.labels, device=device)
    training = dense.training
    dense.eval()
    try:
        with torch.no_grad():
            try:
                dense(torch.zeros(2, dim, device=device))
                out = dense(torch.zeros(len(labels), dim, device=device))
            except Exception as e:
                said = f"{type(e).__name__}: {e}"
                raise ValueError(f"{field}: the dense module fails on the bags' embeddings of"
                                 f" shape (2, {dim}): {said}") from None  # fmt: skip
            try:
                value = loss_fn(out, labels)
                if not isinstance(value, torch.Tensor) or value.numel() != 1:
                    raise TypeError(f"the loss gives {_shape(value)}, not one number")
            except Exception as e:
                raise ValueError(f"{field}: the dense module outputs {_shape(out)} but the"
                                 f" labels {_shape(labels)} go up to {int(labels.max())}:"
                                 f" {type(e).__name__}: {e}") from None  # fmt: skip
    finally:
        dense.train(training)


def due(spec: HybridSpec, step: int) -> bool:
    """Whether to evaluate after `step`: every eval.everySteps steps (0: never between) and
    after the last one."""
    if spec.eval is None:
        return False
    every = spec.eval.every_steps
    return step == spec.steps or (every > 0 and step % every == 0)


def evaluate(table: rpc.RRef, dense: nn.Module, batches: list[Batch], loss_fn: workloads.Loss,
             device: torch.device) -> dict[str, Any]:  # fmt: skip
    """Loss (the mean over bags) and accuracy (argmax against the label; None when the
    outputs are not (batch, classes)) of the table and `dense` on `batches`."""
    ps = table.owner()
    total = correct = 0
    loss_sum, classifies = 0.0, True
    training = dense.training
    dense.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                ids, offsets = torch.tensor(batch.ids), torch.tensor(batch.offsets)
                bags = rpc.rpc_sync(ps, held_out_lookup, args=(table, ids, offsets))
                out = dense(bags.to(device))
                labels = torch.tensor(batch.labels, device=device)
                loss_sum += float(loss_fn(out, labels)) * len(labels)
                if out.dim() == 2:
                    correct += int((out.argmax(1) == labels).sum())
                else:
                    classifies = False
                total += len(labels)
    finally:
        dense.train(training)
    return {"loss": loss_sum / total, "accuracy": correct / total if classifies else None,
            "bags": total}  # fmt: skip
