"""The parameter server of a HybridJob: the EmbeddingBag, and one optimizer per trainer
that steps it as that trainer's gradient for a lookup arrives (inside the backward). The
functions here run on the ps, called over RPC with the table's RRef."""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.trainer import workloads
from pipejob.trainer.runtime import checkpoint
from pipejob.trainer.runtime.optim import optimizer_args


class Table:
    """The ps's EmbeddingBag and one optimizer per trainer (its own momentum, ...), each
    applied to the table as that trainer's gradient for a lookup arrives."""

    def __init__(self, spec: HybridSpec, trainers: list[str]):
        self.module = workloads.hybrid_table(spec)
        optimizer_class, kwargs = optimizer_args(spec.optimizer)
        self.optimizers = {t: optimizer_class(self.module.parameters(), **kwargs)
                           for t in trainers}  # fmt: skip
        self.lock = threading.Lock()  # one update at a time; lookups read between them

    def lookup(self, trainer: str, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The bags, from a leaf that shares the table's weight: when the backward brings
        the leaf its gradient, the hook steps the trainer's optimizer with it, instead of
        the gradient waiting in the dist-autograd context for an optimizer RPC."""
        leaf = self.module.weight.detach().requires_grad_()
        leaf.register_hook(functools.partial(self.step, trainer))
        return F.embedding_bag(ids, leaf, offsets, mode=self.module.mode)

    def step(self, trainer: str, grad: torch.Tensor) -> None:
        weight = self.module.weight
        with self.lock:
            weight.grad = grad
            self.optimizers[trainer].step()
            weight.grad = None


def lookup(table: rpc.RRef, trainer: str, ids: torch.Tensor,
            offsets: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return table.local_value().lookup(trainer, ids, offsets)


def held_out_lookup(table: rpc.RRef, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The bags for evaluation: no gradient, no hook, so the table is never stepped by it."""
    t = table.local_value()
    with torch.no_grad(), t.lock:
        return t.module(ids, offsets)


def table_state(table: rpc.RRef) -> dict[str, torch.Tensor]:
    """The table's state_dict (what nn.EmbeddingBag loads), copied for the output."""
    t = table.local_value()
    with t.lock:
        return {k: v.detach().clone() for k, v in t.module.state_dict().items()}


def table_names(table: rpc.RRef) -> list[str]:
    """The names of the table's state, as a checkpoint indexes them."""
    return list(table.local_value().module.state_dict())


def table_weight(table: rpc.RRef) -> torch.Tensor:
    return table.local_value().module.weight.detach().clone()


def save_table(table: rpc.RRef, directory: str) -> dict[str, Any]:
    """The table and every trainer's optimizer state for it, saved by the ps itself."""
    t = table.local_value()
    with t.lock:
        return checkpoint.save_module(directory, "ps.pt", t.module, t.optimizers)


def load_table(table: rpc.RRef, directory: str, entries: list[dict[str, Any]]) -> None:
    """The table from the checkpoint files that hold it (by name: a server holding part of
    the tables would load its own from them), with each trainer's optimizer state for it:
    a trainer the checkpoint's world had keeps its own (by name), a new one starts fresh."""
    t = table.local_value()
    with t.lock:
        checkpoint.load_named(directory, entries, t.module, t.optimizers)
