"""The spec's `optimizer` section as a torch.optim class and its arguments (both job kinds)."""

from __future__ import annotations

from typing import Any

import torch

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
}
WITH_MOMENTUM = ("sgd", "rmsprop")


def optimizer_args(opt: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, float]]:
    """The torch.optim class and keyword arguments for an `optimizer` section."""
    kwargs = {"lr": opt.lr, "weight_decay": opt.weight_decay}
    if opt.name in WITH_MOMENTUM:
        kwargs["momentum"] = opt.momentum
    return OPTIMIZERS[opt.name], kwargs
