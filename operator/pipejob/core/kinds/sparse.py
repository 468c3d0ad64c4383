"""A HybridJob's spec.sparseOptimizer: how its parameter servers step the tables. Its bounds
are torch's, from the one table of them (core/bounds.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pipejob.core import bounds
from pipejob.core.schema import Field

# Each sparse optimizer's eps unless the spec gives one: torch's Adagrad's and Adam's.
EPS = bounds.SPARSE_EPS
_SPARSE = bounds.SPARSE_OPTIMIZERS


def _torch_bounds(field: str) -> dict[str, float | bool | None]:
    return bounds.loosest(_SPARSE, field).schema()


SPARSE_OPTIMIZER = Field(
    "object",
    "How the parameter servers step the tables: once per step with the trainers' averaged"
    " sparse gradients, on the rows the step touched only; the state lives once per table"
    " (on the servers), not per trainer.",
    fields={
        "name": Field(
            "string",
            "sgd; adagrad; rowwiseAdagrad (one accumulator per row, the"
            " mean of its squared gradients, as FBGEMM's); or adam (lazy: the moments"
            " of touched rows move, as torch.optim.SparseAdam).",
            default="sgd",
            enum=tuple(EPS),
        ),
        "lr": Field(
            "number", "Learning rate; spec.optimizer.lr unless given.", **_torch_bounds("lr")
        ),
        "eps": Field(
            "number",
            "Added to the denominator (adagrad, rowwiseAdagrad, adam; > 0"
            " with adam); 1e-10 for the adagrads and 1e-8 for adam unless given.",
            **_torch_bounds("eps"),
        ),
        "initialAccumulatorValue": Field(
            "number",
            "Starting sum of squared gradients (adagrad, rowwiseAdagrad).",
            default=0.0,
            **_torch_bounds("initialAccumulatorValue"),
        ),
        "beta1": Field(
            "number", "adam's first-moment decay, in [0, 1).", default=0.9, **_torch_bounds("beta1")
        ),
        "beta2": Field(
            "number",
            "adam's second-moment decay, in [0, 1).",
            default=0.999,
            **_torch_bounds("beta2"),
        ),
    },
    rules=tuple(
        r
        for f in ("lr", "eps", "initialAccumulatorValue", "beta1", "beta2")
        for r in bounds.name_rules(_SPARSE, f)
    ),
)


@dataclass(frozen=True, kw_only=True)
class SparseOptimizer:
    name: str
    lr: float  # filled in from spec.optimizer.lr
    eps: float  # filled in by name (EPS)
    initial_accumulator_value: float
    beta1: float
    beta2: float
