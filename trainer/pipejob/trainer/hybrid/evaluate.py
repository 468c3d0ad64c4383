"""A HybridJob trainer's checks and evaluation around its loop: that the dense module fits the
data, before the first step (`check_dense`), and the figures on held-out samples (spec.eval:
the loss, and accuracy for classes or AUC for clicks), on DDP rank 0 while the other trainers
wait. Why there: docs/architecture.md, "A HybridJob's step"."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from pipejob.core.kinds.hybrid import ONE_TABLE, HybridSpec
from pipejob.trainer import workloads
from pipejob.trainer.hybrid import ps
from pipejob.trainer.hybrid.records import HeldOutFigures
from pipejob.trainer.hybrid.replicated import Replicated
from pipejob.trainer.hybrid.router import Router
from pipejob.trainer.runtime import nonfinite
from pipejob.trainer.workloads.recsys import auc, call_dense
from pipejob.trainer.workloads.samples import Batch


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return str(tuple(shape)) if shape is not None else f"a {type(value).__name__}"


def forward(
    spec: HybridSpec,
    dense: nn.Module,
    batch: Batch,
    pooled: dict[str, torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """The dense part on a batch's dense features and its tables' pooled embeddings."""
    if device.type != "cpu":  # on the CPU they are there: no call a table a step
        pooled = {name: p.to(device) for name, p in pooled.items()}
    return call_dense(dense, spec.recommends, batch.dense.to(device), pooled, ONE_TABLE)


def check_dense(
    spec: HybridSpec, dense: nn.Module, loss_fn: workloads.Loss, sample: Batch, device: torch.device
) -> None:
    """Run `dense` on zeros shaped like the pooled embeddings (with the batch's dense
    features), and the loss on its output with the batch's labels; a failure is a ValueError
    naming the field and the shapes. In eval mode and without gradient: the check changes no
    weight and no running statistic."""
    field = "spec.dense.import" if spec.dense.import_ else "the built-in dense model"
    if spec.loss.import_:
        field += " (with spec.loss.import)"
    zeros = {t.name: torch.zeros(len(sample.sample_ids), t.dim) for t in spec.embeddings}
    if spec.recommends:
        pooled = ", ".join(f"{name} {_shape(z)}" for name, z in zeros.items())
        shapes = f"dense features of shape {_shape(sample.dense)} and pooled embeddings {pooled}"
    else:
        shapes = f"the bags' embeddings of shape {_shape(next(iter(zeros.values())))}"
    labels = sample.labels.to(device)
    training = dense.training
    dense.eval()
    try:
        with torch.no_grad():
            try:
                out = forward(spec, dense, sample, zeros, device)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                raise ValueError(f"{field}: the dense module fails on {shapes}: {error}") from None
            try:
                value = loss_fn(out, labels)
                if not isinstance(value, torch.Tensor) or value.numel() != 1:
                    raise TypeError(f"the loss gives {_shape(value)}, not one number")
            except Exception as e:
                raise ValueError(
                    f"{field}: the dense module outputs {_shape(out)} but the"
                    f" labels {_shape(labels)} go up to {labels.max().item():g}:"
                    f" {type(e).__name__}: {e}"
                ) from None
    finally:
        dense.train(training)


def due(spec: HybridSpec, step: int) -> bool:
    """Whether to evaluate after `step`: every eval.everySteps steps (0: never between) and
    after the last one."""
    if spec.eval is None:
        return False
    every = spec.eval.every_steps
    return step == spec.steps or (every > 0 and step % every == 0)


def evaluate(
    spec: HybridSpec,
    router: Router,
    servers: list[str],
    replicated: Replicated,
    dense: nn.Module,
    batches: list[Batch],
    loss_fn: workloads.Loss,
) -> HeldOutFigures:
    """Loss (the mean over samples), accuracy (argmax against the label, for classes) and
    AUC (for clicks) of the tables and `dense` on `batches`; None where a figure does not
    apply to the outputs."""
    total, loss_sum = 0, 0.0
    scores, labels = [], []
    training = dense.training
    dense.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                routed = router.route(batch)
                asked = zip(servers, routed.requests, strict=True)
                replies = [
                    rpc.rpc_async(server, ps.held_out, args=request) for server, request in asked
                ]
                pooled = router.pool([r.wait() for r in replies], routed, batch)
                pooled |= replicated.lookup(batch)
                out = forward(spec, dense, batch, pooled, replicated.device)
                value = float(loss_fn(out, batch.labels.to(replicated.device)))
                # Never a figure from non-finite outputs (runtime/nonfinite.py).
                nonfinite.check_outputs(out, value, f"the held-out batch after {total} samples")
                loss_sum += value * len(batch.labels)
                total += len(batch.labels)
                scores.append(out.detach().cpu())
                labels.append(batch.labels)
    finally:
        dense.train(training)
    accuracy, area = accuracy_and_auc(torch.cat(scores), torch.cat(labels))
    return HeldOutFigures(loss=loss_sum / total, samples=total, accuracy=accuracy, auc=area)


def accuracy_and_auc(
    scores: torch.Tensor, labels: torch.Tensor
) -> tuple[float | None, float | None]:
    """(accuracy, AUC): accuracy when the outputs are (samples, classes) and the labels
    class ids; AUC when they are one logit per sample and the labels clicks; else None."""
    accuracy = area = None
    if scores.dim() == 2 and scores.shape[1] > 1 and not labels.is_floating_point():
        accuracy = int((scores.argmax(1) == labels).sum()) / len(labels)
    elif scores.numel() == len(labels):
        area = auc(scores, labels)
    return accuracy, area
