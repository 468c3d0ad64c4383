"""A HybridJob trainer's replicated tables (spec.embeddings[].placement: replicated): each
whole on every trainer, looked up there with no RPC. After a step's backward the trainers'
gradients of them are summed in one all-reduce, with how often each row was looked up (so
every trainer knows the rows the whole batch touched), and every trainer steps those rows by
the sparse optimizer with the averaged gradient: the update one process makes on the whole
batch, on every trainer alike. A checkpoint holds them once, in replicated.pt (DDP rank 0's,
with their optimizer state). docs/architecture.md, "A HybridJob's step"."""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.core.kinds.tables import replicated
from pipejob.trainer.hybrid import sparse_optimizers
from pipejob.trainer.hybrid.records import FileEntry, Resume
from pipejob.trainer.runtime import checkpoint
from pipejob.trainer.workloads.recsys import initial_rows
from pipejob.trainer.workloads.samples import Batch

FILE = "replicated.pt"  # in a checkpoint


class Replicated:
    """The replicated tables of a trainer, their sparse optimizer, and the rows its last
    lookup touched."""

    def __init__(self, spec: HybridSpec, device: torch.device, resume: Resume | None):
        self.tables = replicated(spec.embeddings)
        self.bags = nn.ModuleDict()
        for t in self.tables:  # dense gradients: all-reduced whole, the tables are small
            # Made at a server's initial rows, not at random first: no second table's bytes.
            made = initial_rows(t, spec.seed, 0, t.rows)
            self.bags[t.name] = nn.EmbeddingBag(t.rows, t.dim, mode=t.mode, _weight=made).to(device)
        weights = [self.bags[t.name].weight for t in self.tables]
        self.optimizer = sparse_optimizers.make(weights, spec.sparse_optimizer) if weights else None
        self.device = device
        self.touched: dict[str, torch.Tensor] = {}
        if resume is not None and self.optimizer is not None:
            self._load(resume.directory, resume.replicated)

    def save(self, directory: str) -> list[FileEntry]:
        """Write the tables and their optimizer state as replicated.pt in `directory` (by
        DDP rank 0: every trainer holds the same); its manifest entry, if any tables."""
        if self.optimizer is None:
            return []
        entry = checkpoint.save_module(directory, FILE, self.bags, {"tables": self.optimizer})
        return [cast(FileEntry, entry)]

    def _load(self, directory: str, entry: FileEntry | None) -> None:
        """The tables and their optimizer state from a checkpoint's replicated.pt."""
        if entry is None:
            names = ", ".join(t.name for t in self.tables)
            raise checkpoint.CheckpointError(
                f"{directory} holds no replicated tables, but {names} are replicated here: a"
                " checkpoint of the tables on the servers (give this job another"
                " checkpoint.path, or the tables their placement then)"
            )
        restored = checkpoint.load_part(directory, entry)
        self.bags.load_state_dict(restored["model"])
        checkpoint.load_optimizer_state(self.optimizer, self.bags, restored["optimizers"]["tables"])

    def lookup(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Each table's pooled embeddings of `batch` (its feature's ids, hashed into its rows
        as the router hashes a sharded table's)."""
        out = {}
        for t in self.tables:
            ids = torch.remainder(batch.ids[t.feature], t.rows).to(self.device)
            out[t.name] = self.bags[t.name](ids, batch.offsets(t.feature).to(self.device))
        return out

    def pooled(self, batch: Batch) -> dict[str, torch.Tensor]:
        """`lookup` for a step: the rows it touches are kept for `step`."""
        self.touched = {
            t.name: torch.remainder(batch.ids[t.feature], t.rows).to(self.device)
            for t in self.tables
        }
        return self.lookup(batch)

    def step(self, trainers: int, dense: torch.Tensor) -> torch.Tensor:
        """After the backward: sum the trainers' gradients and row counts, with `dense` (the
        dense model's gradients, flat), in one all-reduce in the trainers' DDP group; step
        the rows any trainer touched by the averaged gradient. Returns the trainers' average
        of `dense`."""
        assert self.optimizer is not None, "a step of no replicated tables"
        weights = [self.bags[t.name].weight for t in self.tables]
        grads = [torch.zeros_like(w) if w.grad is None else w.grad for w in weights]
        counts = [
            torch.bincount(self.touched[t.name], minlength=t.rows).to(weights[0].dtype)
            for t in self.tables
        ]
        flat = torch.cat([g.reshape(-1) for g in grads] + counts + [dense.to(self.device)])
        dist.all_reduce(flat)
        sizes = [g.numel() for g in grads] + [t.rows for t in self.tables] + [dense.numel()]
        parts = flat.split(sizes)
        for k, w in enumerate(weights):
            rows = parts[len(weights) + k].nonzero().squeeze(1)
            summed = parts[k].view_as(w).index_select(0, rows)
            w.grad = sparse_optimizers.gradient(rows, summed, w.shape, trainers)
        self.optimizer.step()
        for w in weights:
            w.grad = None
        return parts[-1] / trainers

    def state(self) -> dict[str, torch.Tensor]:
        """The tables' weights, by table name (for the trained model's file)."""
        return {t.name: self.bags[t.name].weight.detach().cpu() for t in self.tables}
