"""spec.ema on one stage: the exponential moving average of the stage's own parameters,
updated after each applied optimizer step. It is shaped as an optimizer is (`param_groups`,
`state` by parameter: its "ema" tensor and its "step" count), so checkpoints keep it by the
parameters' names, as optimizer state, and a resume on another cut loads each name's."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

from pipejob.core.averaged import Ema

CHECKPOINT_KEY = "ema"  # beside "optimizer" in a stage's checkpoint file


class Average:
    """The average of `params` (starting as their values now), by spec.ema `settings`."""

    def __init__(self, settings: Ema, params: Iterable[torch.Tensor]):
        self.settings = settings
        self.param_groups = [{"params": list(params)}]
        self.state: defaultdict[torch.Tensor, dict[str, torch.Tensor]] = defaultdict(dict)
        for p in self.param_groups[0]["params"]:
            self.state[p] = {
                "ema": p.detach().clone(),
                # a float counter on the CPU, as an optimizer's "step" (checkpoints keep it so)
                "step": torch.tensor(0.0, dtype=torch.float64),
            }

    @torch.no_grad()
    def update(self) -> None:
        """After an applied optimizer step: the step counted; the average set to the weights
        while in the warmup, else moved towards them on every everySteps-th step."""
        s = self.settings
        for p in self.param_groups[0]["params"]:
            state = self.state[p]
            state["step"] += 1
            k = int(state["step"].item())
            if k <= s.warmup:
                state["ema"].copy_(p)
            elif (k - s.warmup) % s.every_steps == 0:
                state["ema"].lerp_(p, 1.0 - s.decay)

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the weights and the average in place: the model then computes (and its
        state is) the average's; a second swap restores it."""
        for p in self.param_groups[0]["params"]:
            average = self.state[p]["ema"]
            held = p.detach().clone()
            p.copy_(average)
            average.copy_(held)
