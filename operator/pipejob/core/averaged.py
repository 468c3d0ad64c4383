"""spec.ema, a PipelineJob's exponential moving average of its weights (timm's ModelEmaV3,
diffusers' EMAModel): its table and the typed `Ema` each stage keeps it by
(trainer/runtime/ema.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pipejob.core.schema import Field, integer

EMA_ONLY, BOTH = "ema", "both"

EMA = Field(
    "object",
    "Each stage keeps an exponential moving average of its own parameters: it starts as the"
    " initial weights; after optimizer step k (counted from 1) it is the weights while k <="
    " warmup, else, every everySteps steps, decay * average + (1 - decay) * weights. It is"
    " kept in checkpoints (by parameter name: a resume on another shape keeps it), the"
    " evaluation reports it beside the weights, and spec.output holds it.",
    fields={
        "decay": Field(
            "number",
            "How much of the average each update keeps.",
            default=0.999,
            minimum=0,
            maximum=1,
            exclusive_minimum=True,
            exclusive_maximum=True,
        ),
        "everySteps": integer(
            "Update the average every this many optimizer steps.", default=1, minimum=1
        ),
        "warmup": integer(
            "Optimizer steps through which the average is the weights themselves (diffusers'"
            " update_after_step).",
            default=0,
        ),
        "output": Field(
            "string",
            "What spec.output holds: the average (ema), or the weights in output.path and"
            " the average in its subfolder ema/ (both).",
            default=EMA_ONLY,
            enum=(EMA_ONLY, BOTH),
        ),
    },
    section=True,
)


@dataclass(frozen=True, kw_only=True)
class Ema:
    """spec.ema."""

    decay: float
    every_steps: int = 1
    warmup: int = 0
    output: str = EMA_ONLY
