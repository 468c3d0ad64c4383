"""A piece as the pipelining engine's PipelineStages run it (`FlatPiece`): torch's schedules pass
only tensors between stages and hand the loss the last stage's outputs as a tuple of tensors,
so the last piece's output is flattened and its structure kept to rebuild it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class FlatPiece(nn.Module):
    """A piece as a PipelineStage runs it: the last one's output as a tuple of its tensors,
    its structure (a dict, a Hugging Face ModelOutput) kept to rebuild it for the loss; any
    other piece's outputs are sent to the next stage, so they must be tensors. An output
    that is a view of another tensor is passed on as a copy: torch's backwards detach their
    outputs in place, which a view refuses."""

    def __init__(self, piece: nn.Module, last: bool, where: str):
        super().__init__()
        self.piece, self.last, self.where = piece, last, where
        self.rebuild: Callable[[tuple[torch.Tensor, ...]], Any] = lambda ts: ts

    def forward(self, *x: Any) -> Any:
        y = self.piece(*x)
        if self.last:
            values, self.rebuild = flatten(y)
        else:
            values = y if isinstance(y, tuple) else (y,)
            others = [type(v).__name__ for v in values if not isinstance(v, torch.Tensor)]
            if others:
                raise ValueError(
                    f"spec.engine pipelining passes only tensors between stages; the model"
                    f" passes {', '.join(others)} at {self.where}: cut elsewhere"
                    " (spec.splitPoints) or use spec.engine rpc"
                )
        return tuple(v.clone() if v._base is not None else v for v in values)


def flatten(value: Any) -> tuple[tuple[torch.Tensor, ...], Callable[..., Any]]:
    """The tensors of an output (a tensor, a tuple or list, a dict or ModelOutput of them),
    and what makes the output again from them."""
    if isinstance(value, torch.Tensor):
        return (value,), lambda ts: ts[0]
    if isinstance(value, tuple | list | dict):
        keys = list(value) if isinstance(value, dict) else list(range(len(value)))
        parts = [flatten(value[k]) for k in keys]
        sizes = [len(ts) for ts, _ in parts]

        def rebuild(ts: tuple[torch.Tensor, ...]) -> Any:
            items, at = [], 0
            for (_, make), n in zip(parts, sizes, strict=True):
                items.append(make(ts[at : at + n]))
                at += n
            if isinstance(value, dict):
                return type(value)(**dict(zip(keys, items, strict=True)))
            return type(value)(items)

        return tuple(t for ts, _ in parts for t in ts), rebuild
    return (), lambda ts: value  # a constant: the same in every micro-batch
