"""The small float32 MLP of tests/test_precision.py's fp16 check, as a factory a stage
process can import by name (the eager path's stages build their modules from the job's
factory: tests/test_eager.py's fp16 world)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn


def mlp32() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(
        OrderedDict(
            [
                ("fc1", nn.Linear(5, 32)),
                ("act1", nn.Tanh()),
                ("fc2", nn.Linear(32, 32)),
                ("act2", nn.Tanh()),
                ("fc3", nn.Linear(32, 3)),
            ]
        )
    )
