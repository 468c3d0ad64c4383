"""spec.eval.best and spec.eval.earlyStopping: which held-out figure judges the evaluations,
whether lower or higher is better, and when a run that stopped improving ends (the Hugging
Face Trainer's metric_for_best_model, load_best_model_at_end, EarlyStoppingCallback)."""

from __future__ import annotations

from dataclasses import dataclass

from pipejob.core.schema import Field, integer

LOWER_IS_BETTER = ("loss", "perplexity")
METRICS = (*LOWER_IS_BETTER, "accuracy")

BEST = Field(
    "object",
    "Keep the model of the best evaluation: spec.output is written at each evaluation better"
    " than every one before, and not again at the end, so it holds the best step's weights.",
    fields={
        "metric": Field(
            "string",
            "The held-out figure that judges (perplexity for a language model, accuracy for"
            " a classifier).",
            default="loss",
            enum=METRICS,
        ),
        "mode": Field(
            "string",
            "min or max is better; auto: min for loss and perplexity, max for accuracy.",
            default="auto",
            enum=("auto", "min", "max"),
        ),
    },
    section=True,
)

EARLY_STOPPING = Field(
    "object",
    "End the run, successfully, once `patience` evaluations in a row have not bettered the"
    " best one (best.metric, best.mode) by more than minDelta.",
    fields={
        "patience": integer("Evaluations without improvement that end the run.", minimum=1),
        "minDelta": Field(
            "number",
            "The least change of the metric that counts as an improvement.",
            default=0.0,
            minimum=0,
        ),
    },
    required=("patience",),
    section=True,
)


@dataclass(frozen=True, kw_only=True)
class Best:
    """spec.eval.best."""

    metric: str = "loss"
    mode: str = "auto"

    @property
    def lower_is_better(self) -> bool:
        return self.mode == "min" or (self.mode == "auto" and self.metric in LOWER_IS_BETTER)


@dataclass(frozen=True, kw_only=True)
class EarlyStopping:
    """spec.eval.earlyStopping."""

    patience: int
    min_delta: float = 0.0
