"""spec.optimizer, which every kind has: its table (each bound the loosest torch.optim puts
on the field, core/bounds.py) and the typed `Optimizer` the trainer steps with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipejob.core import bounds
from pipejob.core.schema import Field, Rule, integer


def _torch_bounds(field: str) -> dict[str, Any]:
    """A spec.optimizer field's bound: the loosest torch.optim's classes put on it (bounds.py)."""
    return bounds.loosest(bounds.OPTIMIZERS, field).schema()


OPTIMIZER = Field(
    "object",
    "The optimizer every parameter is stepped with: a PipelineJob's by each stage, where its"
    " parameters live; a HybridJob's dense layers by each trainer's own (its tables by"
    " spec.sparseOptimizer, on the parameter servers).",
    fields={
        "name": Field(
            "string",
            "Optimizer from torch.optim.",
            default="sgd",
            enum=tuple(bounds.OPTIMIZERS),
        ),
        "lr": Field("number", "Learning rate.", default=0.05, **_torch_bounds("lr")),
        "momentum": Field(
            "number", "Momentum (sgd and rmsprop only).", default=0.0, **_torch_bounds("momentum")
        ),
        "weightDecay": Field(
            "number", "L2 weight decay.", default=0.0, **_torch_bounds("weightDecay")
        ),
        "clipGradNorm": Field(
            "number",
            "Clip the gradients to this global L2 norm before each optimizer step:"
            " the norm over every parameter of the whole model (every stage; with replicas,"
            " after their average), as torch.nn.utils.clip_grad_norm_ on the model in one"
            " process. Omit it to step unclipped.",
            minimum=0,
            exclusive_minimum=True,
        ),
        "schedule": Field(
            "object",
            "How the learning rate changes per optimizer step: linear warmup from lr /"
            " warmupSteps to lr over the first warmupSteps steps, then `decay` from lr to"
            " minLr over the remaining steps. Omit it for a constant lr.",
            fields={
                "warmupSteps": integer("Optimizer steps of linear warmup.", default=0),
                "decay": Field(
                    "string",
                    "After the warmup: keep lr (constant), or decay it"
                    " to minLr linearly or along a half cosine.",
                    default="constant",
                    enum=("constant", "linear", "cosine"),
                ),
                "minLr": Field(
                    "number",
                    "The learning rate the decay ends at (after the last step).",
                    default=0.0,
                    minimum=0,
                ),
            },
            section=True,
        ),
    },
    rules=(
        Rule(
            "!(self.name in ['adam', 'adamw']) || self.momentum == 0.0",
            "adam and adamw have no momentum (they use betas): leave momentum out",
            "momentum",
            lambda o: o["name"] not in ("adam", "adamw") or o["momentum"] == 0.0,
        ),
        Rule(
            "!has(self.schedule) || self.schedule.minLr <= self.lr",
            "schedule.minLr must be at most lr (the decay goes down from lr to minLr)",
            "schedule.minLr",
            lambda o: "schedule" not in o or o["schedule"]["minLr"] <= o["lr"],
        ),
    ),
)


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    """spec.optimizer, as every stage and trainer steps with it (trainer/runtime/optim.py)."""

    name: str
    lr: float
    momentum: float
    weight_decay: float
    clip_grad_norm: float | None = None
    schedule: Schedule | None = None


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """spec.optimizer.schedule: warmup, then the decay to min_lr."""

    warmup_steps: int
    decay: str
    min_lr: float
