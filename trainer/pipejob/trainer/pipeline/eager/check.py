"""The eager path's placement checked in one process before the world forms: one micro-batch
through the model with each module that is to live on a stage called as a stage would call
it (a copy of the module, of its inputs and of its outputs), against the model called
directly. A module whose forward changes Python state that the glue reads (MONAI DynUNet's
deep-supervision list) gives another result through a copy: it stays with the glue."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from pipejob.trainer.pipeline.eager.placement import (
    CHANGES_STATE,
    Placement,
    replace,
    restore,
)


def _copied(value: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), value)


class _AsOnStage(nn.Module):
    """A copy of `module`, called with copies of its inputs, giving copies of its outputs."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.copy = copy.deepcopy(module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _copied(self.copy(*_copied(args), **_copied(kwargs)))


@contextmanager
def _swapped(model: nn.Module, names: list[str]) -> Iterator[None]:
    """The modules `names` replaced by their copies as a stage would call them (under every
    name each has), inside."""
    originals = [replace(model, name, _AsOnStage(model.get_submodule(name))) for name in names]
    try:
        yield
    finally:
        for held in reversed(originals):
            restore(model, held)


def _same(a: Any, b: Any) -> bool:
    left, lspec = tree_flatten(a)
    right, rspec = tree_flatten(b)
    if lspec != rspec or len(left) != len(right):
        return False
    for x, y in zip(left, right, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or not torch.equal(x.nan_to_num(), y.nan_to_num()):
                return False
        elif isinstance(x, _PLAIN) and x != y:
            return False
        elif type(x) is not type(y):  # another object (a cache): by its type alone
            return False
    return True


_PLAIN = (int, float, str, bool, bytes, type(None))


def _result(
    model: nn.Module, run: Callable[[], Any], names: list[str], other: Callable[[], Any]
) -> Any:
    """What `run()` gives with `names` called as on a stage, from the same random state and
    the same buffers (BatchNorm's statistics are put back after), right after the model ran
    directly on `other()`'s batch: Python state a module writes and the glue reads then
    holds that batch's values, which a copy's call does not overwrite."""
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            other()
            with _swapped(model, names):
                torch.manual_seed(0)
                return _copied(run())
    finally:
        model.load_state_dict(buffers)


def _same_through_copies(
    model: nn.Module,
    run: Callable[[], Any],
    names: list[str],
    direct: Any,
    other: Callable[[], Any],
) -> bool:
    """Whether the model gives `direct` with `names` called as on a stage (an error there,
    as DynUNet's glue reading a list its copied layer never wrote, is a difference)."""
    try:
        return _same(direct, _result(model, run, names, other))
    except Exception:
        return False


def check(
    model: nn.Module,
    run: Callable[[], Any],
    place: Callable[[dict[str, str]], Placement],
    other: Callable[[], Any],
) -> Placement:
    """The placement `place(kept)` gives with every module that gives another result
    through a copy kept with the glue (`kept`, naming why), once the rest give the model's
    own result together. `run` and `other`: forwards of two different micro-batches."""
    direct = _result(model, run, [], other)

    def same(names: list[str]) -> bool:
        return _same_through_copies(model, run, names, direct, other)

    placement = place({})
    if same(placement.remote()):
        return placement
    kept = {n: CHANGES_STATE for n in placement.remote() if not same([n])}
    placement = place(kept)
    if not kept or not same(placement.remote()):
        raise ValueError(
            "the eager path cannot place this model: called as its stages would call them"
            " (through copies), its modules give another result than the model"
            + (f" (kept with the glue: {', '.join(kept)})" if kept else "")
        )
    return placement
