"""A user's model whose every forward takes at least a given time: a test that races a run's
end against the cluster's changes (test_elastic_e2e.py's grow-back, which needs the shrunk
world still training when the room comes back) keeps its steps from outpacing them, however
fast the engine has become."""

from __future__ import annotations

import time

import torch
from torch import nn

from userpkg.vision import small_cnn


class Pace(nn.Module):
    """Passes its input on after `seconds`. Tracing it (every process traces the model to cut
    it) passes at once: only the work is paced."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.fx.Proxy):
            time.sleep(self.seconds)
        return x


def cnn(seconds: float, classes: int = 10) -> nn.Module:
    """userpkg.vision's small CNN with a Pace at its end: the last stage holds it."""
    return nn.Sequential(*small_cnn(classes=classes), Pace(seconds))
