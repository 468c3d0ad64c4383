"""A batch's inputs or labels as the data gives them: a tensor, or a dict, tuple or list of
tensors (an audio seq2seq model's {input_features, decoder_input_ids}, a label dict), taken
apart by samples along each tensor's first dimension as one process's batch would be."""

from __future__ import annotations

from typing import Any

import torch

from pipejob.trainer.workloads.cut import tensors


def samples(value: Any) -> int:
    """The batch's samples: the first dimension of its first tensor (1 for none)."""
    for t in tensors(value):
        return len(t) if t.dim() else 1
    return 1


def take(value: Any, n: int) -> Any:
    """The first `n` samples of every tensor in `value`."""
    return _each(value, lambda t: t[:n] if t.dim() else t)


def first(value: Any) -> Any:
    """The first sample of every tensor in `value` (a sample's shapes, for a message)."""
    return _each(value, lambda t: t[0] if t.dim() else t)


def split(value: Any, parts: int) -> list[Any]:
    """`value` as `parts` consecutive pieces by samples (tensor_split's sizes)."""
    if isinstance(value, torch.Tensor):
        return list(value.tensor_split(parts))
    if isinstance(value, dict):
        pieces = {k: split(v, parts) for k, v in value.items()}
        return [type(value)(**{k: p[i] for k, p in pieces.items()}) for i in range(parts)]
    if isinstance(value, tuple | list):
        columns = [split(v, parts) for v in value]
        return [type(value)(c[i] for c in columns) for i in range(parts)]
    return [value] * parts


def to(value: Any, device: torch.device | str) -> Any:
    """Every tensor in `value` on `device`."""
    return _each(value, lambda t: t.to(device))


def pinned(value: Any) -> Any:
    """Every tensor in `value` in page-locked memory (those that are not yet)."""
    return _each(value, lambda t: t if t.is_pinned() else t.pin_memory())


def _each(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return type(value)(**{k: _each(v, fn) for k, v in value.items()})
    if isinstance(value, tuple | list):
        return type(value)(_each(v, fn) for v in value)
    return value
