"""The master's check that the data fits the model before any stage is built: two samples run
through the model on the meta device (shapes only). It refuses only errors of shapes; what
the meta device cannot evaluate it reports, and the stages check it on the first batch (their
cost measuring runs the real data through every piece: stage_build.py)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pipejob.trainer import workloads
from pipejob.trainer.pipeline.balance import shape
from pipejob.trainer.workloads import batch_values, metrics
from pipejob.trainer.workloads.model_guards import unchanged
from pipejob.trainer.workloads.refusals import construct
from pipejob.trainer.workloads.standins import META

# What torch and the libraries say when shapes do not fit (the meta kernels check shapes
# as the real ones do): only these are the data's fault.
_SHAPES = re.compile(
    r"shape|size|dim|channel|must match|doesn't match|does not match|cannot be"
    r" multiplied|expected .*input|out of range|mismatch",
    re.IGNORECASE,
)


def fits_model(model: nn.Module, inputs: Any, labels: Any, loss: workloads.Loss) -> str | None:
    """Refuse before the first step, saying both shapes, when the data does not fit the
    model: its input, or its labels against the model's output through the loss. Run on
    the meta device, in eval mode, with the model's buffers swapped for meta ones for the
    call (not a deep copy: a model with torch's deprecated weight norm refuses one).
    Returns what could not be checked there and why (None when all was), for the log."""
    inputs, labels = batch_values.take(inputs, 2), batch_values.take(labels, 2)  # a dict's too
    training = model.training
    buffers = {name: b.to(META) for name, b in model.named_buffers(remove_duplicate=False)}
    try:
        with torch.no_grad(), unchanged(model):  # a forward's settings stay as built
            outputs = torch.func.functional_call(
                model.eval(), buffers, (batch_values.to(inputs, META),)
            )
    except Exception as e:
        return _unchecked_or_refused(
            e,
            f"whether inputs of shape {shape(inputs)} fit spec.model",
            f"spec.data: inputs of shape {shape(inputs)} do not fit spec.model",
        )
    finally:
        model.train(training)
    try:
        loss(outputs, batch_values.to(labels, META))
    except metrics.NeedsLoss as e:  # no shape can make the default loss take this output
        raise ValueError(f"spec.loss: the model returns {shape(outputs)}: {e}") from None
    except Exception as e:
        got = ", ".join(shape(t) for t in batch_values.tensors(outputs))  # a ModelOutput's too
        return _unchecked_or_refused(
            e,
            f"whether the model's output {got} fits the labels",
            f"spec.data: the model's output {got} does not fit the labels"
            f" {shape(labels)} in spec.loss",
        )
    return None


def _unchecked_or_refused(error: Exception, what: str, refusal: str) -> str:
    """What a check that failed on the meta device means: where the shapes do not fit, the
    data's fault (refused: `refusal`, then the error); else `what` could not be checked."""
    if not _about_shapes(error):
        return _unchecked(what, error)
    raise ValueError(f"{refusal}: {type(error).__name__}: {error}") from None


def _about_shapes(error: Exception) -> bool:
    """Whether an error on the meta device says the shapes do not fit (not that the meta
    device cannot run something: a value read into Python, an autocast, a kernel it lacks,
    a rule of a meta kernel about dtypes, which mirror CUDA's: a Mixtral's experts'
    grouped matmul wants bfloat16 there, not on the CPU)."""
    message = str(error)
    if isinstance(error, NotImplementedError) or "meta" in message.lower():
        return False
    if "dtype" in message.lower() or "scalartype" in message.lower():
        return False
    return bool(_SHAPES.search(message))


def _unchecked(what: str, error: Exception) -> str:
    return (
        f"spec.data: {what} was not checked before the stages were built: the model does"
        f" not run on the meta device ({construct(error)}); the stages check it on the"
        " first batch"
    )
