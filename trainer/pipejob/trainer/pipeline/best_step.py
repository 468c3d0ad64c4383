"""spec.eval.best and earlyStopping on the master: each evaluation judged against the best
before it (the Hugging Face Trainer's rules: any improvement is the new best; one of more
than minDelta resets the patience), the output written at each new best, and the run ended
once `patience` evaluations in a row brought none."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipejob.core.best_model import Best, EarlyStopping
from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline.run_json import BestFigures
from pipejob.trainer.runtime import monitor, world
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads.metrics import HeldOutEvaluation


@dataclass
class Judge:
    """The best evaluation so far (its `value` of best.metric, its `step`) and how many
    evaluations in a row have not bettered it by more than minDelta (`stale`)."""

    best: Best | None
    stopping: EarlyStopping | None
    value: float | None = None
    step: int | None = None
    stale: int = 0

    @classmethod
    def of(cls, spec: PipelineSpec, first: int) -> Judge:
        """spec.eval's judge. A run resumed after step `first` starts from the best the
        output holds (its model.json's evaluation, of a step up to `first`), so a restart
        does not write a worse one over it; its patience starts afresh."""
        if spec.eval is None:
            return cls(None, None)
        judge = cls(spec.eval.best, spec.eval.early_stopping)
        if judge.best is None or not first or spec.output is None:
            return judge
        try:
            held = json.loads((Path(spec.output.path) / "model.json").read_text())["evaluation"]
            value, step = float(held[judge.best.metric]), int(held["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return judge  # no output yet, or one without that figure
        if step <= first:
            judge.value, judge.step = value, step
        return judge

    def judge(self, figures: HeldOutEvaluation) -> bool:
        """Whether the evaluation `figures` is the best so far (noted, and counted against
        the patience where it is not better by more than minDelta)."""
        if self.best is None:
            return False
        value = figures.get(self.best.metric)
        if value is None:
            raise ValueError(
                f"spec.eval.best.metric: the evaluation has no {self.best.metric} (it has"
                f" {', '.join(k for k in figures if k not in ('step', 'samples'))})"
            )
        lower = self.best.lower_is_better
        better = self.value is None or (value < self.value if lower else value > self.value)
        if self.stopping is not None:
            beyond = self.value is None or abs(value - self.value) > self.stopping.min_delta
            self.stale = 0 if better and beyond else self.stale + 1
        if better:
            self.value, self.step = value, figures["step"]
        return better

    def stop_reason(self) -> str | None:
        """Why the run ends here (early stopping), or None."""
        if self.stopping is None or self.stale < self.stopping.patience:
            return None
        assert self.best is not None and self.value is not None
        return (
            f"early stopping: {self.stale} evaluation(s) in a row without bettering the best"
            f" {self.best.metric} ({self.value:.6g}, step {self.step}) by more than"
            f" {self.stopping.min_delta:g}"
        )

    def after(self, env: Env, figures: HeldOutEvaluation, write: Callable[[], None] | None) -> bool:
        """After an evaluation: `write` the output at a new best; whether the run ends."""
        if self.judge(figures) and write is not None:
            write()
            world.log(env, f"the best evaluation so far, step {self.step}: output written")
        reason = self.stop_reason()
        if reason is not None:
            world.log(env, f"{reason}: the run ends after step {figures['step']}")
            monitor.board().phase("training", reason)  # /progress's message: the status's
        return reason is not None

    def figures(self) -> BestFigures:
        """The summary's: the best evaluation's step and value, and why the run stopped."""
        if self.best is None:
            return {}
        best = {"metric": self.best.metric, "value": self.value, "step": self.step}
        return {"best": best, "stoppedEarly": self.stop_reason()}
