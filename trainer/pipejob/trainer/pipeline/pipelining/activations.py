"""How many bytes of activations a stage holds for its backwards, at most: what a schedule
decides (GPipe keeps every micro-batch's until its backward, 1F1B at most as many as there
are stages). Counted exactly, on any device, from what autograd saves for the backward: each
tensor saved by the forwards (and the loss), but the parameters, once per storage, from when
it is saved until autograd lets it go."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import torch


class _Saved:
    """A saved tensor, counted while autograd keeps it."""

    __slots__ = ("meter", "storage", "tensor")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor, storage: int):
        self.meter, self.tensor, self.storage = meter, tensor, storage

    def __del__(self) -> None:
        self.meter._release(self.storage)


class ActivationMeter:
    """The bytes of the tensors autograd saves inside `counting()`, now and at most, but
    those of `parameters` (weights a layer saves are not activations)."""

    def __init__(self, parameters: Iterable[torch.Tensor]):
        self._parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self._lock = threading.Lock()
        self._held: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self.now = self.peak = 0

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._parameters or storage.nbytes() == 0:
            return tensor
        with self._lock:
            held = self._held.setdefault(key, [0, storage.nbytes()])
            held[0] += 1
            if held[0] == 1:
                self.now += held[1]
                self.peak = max(self.peak, self.now)
        return _Saved(self, tensor, key)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        with self._lock:
            held = self._held[key]
            held[0] -= 1
            if held[0] == 0:
                self.now -= held[1]
                del self._held[key]

    @contextmanager
    def counting(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
