"""Held-out evaluation on the eager path: the model's own forward in eval mode without
autograd and in the job's precision, the stages' modules too (BatchNorm's statistics used,
not updated; no dropout), one batch at a time, tallied as the traced path tallies
(workloads/metrics.py); with spec.ema, the average's figures too."""

from __future__ import annotations

import time

import torch
from torch import nn

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer import workloads
from pipejob.trainer.pipeline.eager import remote
from pipejob.trainer.pipeline.eager.moving_average import Averages
from pipejob.trainer.pipeline.eager.one_step import Stages, computed
from pipejob.trainer.pipeline.stage_base import AUTOCAST
from pipejob.trainer.pipeline.summary import report_evaluation
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads import data
from pipejob.trainer.workloads.metrics import HeldOutEvaluation, Tally


def due(spec: PipelineSpec, step: int) -> bool:
    """Whether to evaluate after `step` (1-based): every eval.everySteps, and after the last."""
    if spec.eval is None:
        return False
    every = spec.eval.every_steps
    return step == spec.steps or (every > 0 and step % every == 0)


def evaluate(
    env: Env[PipelineSpec],
    held: data.HeldOut,
    model: nn.Module,
    stages: Stages,
    loss: workloads.Loss,
    step: int,
    averages: Averages | None = None,
) -> HeldOutEvaluation:
    """The held-out figures after `step` (with spec.ema, the average's beside the weights',
    under "ema"), logged and on the progress board."""
    start = time.perf_counter()
    figures: HeldOutEvaluation = {
        "step": step,
        **tallied(env.spec, held, model, stages, loss).result(),
    }
    more = ""
    if averages is not None:
        with averages.swapped():
            figures["ema"] = tallied(env.spec, held, model, stages, loss).result()
        more = f"; ema: loss {figures['ema']['loss']:.4f}"
    report_evaluation(env, figures, time.perf_counter() - start, more)
    return figures


def tallied(
    spec: PipelineSpec, held: data.HeldOut, model: nn.Module, stages: Stages, loss: workloads.Loss
) -> Tally:
    """The held-out set's figures through the model as it is (replica 0's stages)."""
    assert spec.eval is not None
    tally = Tally(data.task(spec))
    stages.on_each(remote.set_training, False)
    model.eval()
    try:
        with torch.no_grad():
            for inputs, labels in held.batches(spec.eval.batches):
                tally.add(computed(model, inputs, AUTOCAST[spec.precision]), labels, loss)
    finally:
        model.train()
        stages.on_each(remote.set_training, True)
    return tally
