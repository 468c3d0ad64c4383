"""A user's model whose work gets stuck while its process lives on: a layer that, once a
trigger file exists, waits forever (as a read from a hung file system or a lock that is never
released would), in whichever process computes it. The process's other threads, its
heartbeat among them, keep running. What `test_watchdog.py` brings with `import:` to make a
world stop making progress without any member stopping."""

from __future__ import annotations

import os
import threading

import torch
from torch import nn

from userpkg.bags import mlp
from userpkg.vision import small_cnn

_NEVER = threading.Event()  # nobody sets it


class Gate(nn.Module):
    """Passes its input on; once `trigger` exists, blocks forever, in the process of RPC rank
    `rank` only (torch's RANK), or in any process when `rank` is None. Tracing it (every
    process traces the model to cut it) passes: the work is stuck, not the cut."""

    def __init__(self, trigger: str, rank: int | None = None):
        super().__init__()
        self.trigger, self.rank = trigger, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.fx.Proxy):  # the cut traces the forward: no work yet
            return x
        mine = self.rank is None or os.environ.get("RANK") == str(self.rank)
        if mine and os.path.exists(self.trigger):
            _NEVER.wait()
        return x


def cnn(trigger: str, rank: int | None = None, classes: int = 10) -> nn.Module:
    """userpkg.vision's small CNN with a Gate at its end: the last stage holds it."""
    return nn.Sequential(*small_cnn(classes=classes), Gate(trigger, rank))


def dense(trigger: str, rank: int, dim: int, hidden: int, classes: int) -> nn.Module:
    """A HybridJob's dense model that gets stuck on the trainer of RPC rank `rank`."""
    return nn.Sequential(Gate(trigger, rank), mlp(dim, hidden, classes))
