"""A HybridJob parameter server: its shards of the tables (core/kinds/tables.py places them)
and the sparse optimizer that steps them (sparse_optimizers.py). Each trainer calls
`exchange` once a step; the server steps the rows a step touched once every trainer's
gradients are in. The functions at the end run on the server, called over RPC by the master
and the trainers. How and why: docs/architecture.md, "A HybridJob's step"."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.rpc as rpc
from torch import Tensor, nn

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.core.kinds.tables import Shard, Table
from pipejob.trainer.hybrid import sparse_optimizers
from pipejob.trainer.hybrid.pooling import Pooled, groups, pool, row_gradients
from pipejob.trainer.hybrid.records import (
    FileEntry,
    SavedServer,
    SavedShard,
    ServerFigures,
    ServerSize,
)
from pipejob.trainer.runtime import checkpoint, world
from pipejob.trainer.runtime.checkpoint import TorchState
from pipejob.trainer.workloads.recsys import BLOCK, initial_rows

Future = torch.futures.Future


def group_parameter(
    shards: list[Shard], members: list[int], tables: dict[str, Table], seed: int
) -> nn.Parameter:
    """A group's shards at their initial rows, one after the other, made a block at a time
    (no shard is ever held twice)."""
    out = torch.empty(sum(shards[k].rows for k in members), shards[members[0]].dim)
    first = 0
    for k in members:
        p = shards[k]
        for lo in range(0, p.rows, BLOCK):
            hi = min(lo + BLOCK, p.rows)
            made = initial_rows(tables[p.table], seed, p.start + lo, p.start + hi)
            out[first + lo : first + hi] = made[:, p.columns]
        first += p.rows
    return nn.Parameter(out)


class Server:
    def __init__(self, spec: HybridSpec, index: int, trainers: int):
        self.spec, self.index, self.trainers = spec, index, trainers
        self.shards = spec.placement()[index]
        tables = {t.name: t for t in spec.embeddings}
        self.groups = groups(self.shards)
        self.joined = [
            group_parameter(self.shards, members, tables, spec.seed)
            for _, _, members in self.groups
        ]
        self.first: list[int] = []  # each shard's first row in its group's parameter
        self.weights: list[torch.Tensor] = []  # each shard: its rows of the group's parameter
        for weight, (_, _, members) in zip(self.joined, self.groups, strict=True):
            first = 0
            for k in members:
                self.first.append(first)
                self.weights.append(weight.detach()[first : first + self.shards[k].rows])
                first += self.shards[k].rows
        self.first_rows = torch.tensor(self.first)  # as a lookup adds them to its ids
        self.group_of = [g for g, (_, _, members) in enumerate(self.groups) for _ in members]
        # A server may hold nothing (every table replicated, or fewer rows than servers).
        self.optimizer = (
            sparse_optimizers.make(self.joined, spec.sparse_optimizer) if self.joined else None
        )
        self.lock = threading.Lock()
        self.kept: dict[str, list[Pooled]] = {}  # each trainer's last lookup, per group
        self.collected: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.queue: list[tuple[Callable[[], Any], Future]] = []  # reads waiting for a step
        self.dense: dict[str, torch.Tensor] = {}  # each trainer's piece of the dense gradients
        self.dense_mean: torch.Tensor | None = None  # their average, of the last step
        self.steps = self.rows_updated = 0

    # ---- the step

    def exchange(
        self,
        trainer: str,
        grads: torch.Tensor | None,
        ids: torch.Tensor | None,
        lengths: torch.Tensor | None,
        dense: torch.Tensor | None = None,
    ) -> Future:
        """A trainer's call of a step: the gradients of its last lookup and its piece of the
        dense model's gradients (None: none pending; averaged elsewhere), this step's ids
        (None: a flush). Its value: (the pooled embeddings, flat: each shard's (batch, width)
        after the last, in the server's order; or None, the trainers' average of the dense
        piece once all are in, or None)."""
        with self.lock:
            if grads is not None:
                self._collect(trainer, grads, dense)

            def work() -> tuple[torch.Tensor | None, torch.Tensor | None]:
                pooled = None if ids is None else self.lookup(ids, cast(Tensor, lengths), trainer)
                return pooled, None if dense is None else self.dense_mean

            # A lookup waits for a half-collected step where this trainer's gradients are in it;
            # one from a trainer not in it (its first call, or first after a flush) reads now.
            if trainer in self.collected:
                future = self._when_settled(work)
            else:  # no callbacks on the future yet: set under the lock
                future = Future()
                _finish([_outcome(work, future)])
            ready = self._drain()
        _finish(ready)
        return future

    def read(self, work: Callable[[], Any]) -> Future:
        """`work`'s value once no step is half collected (the tables as one step left them)."""
        with self.lock:
            future = self._when_settled(work)
            ready = self._drain()
        _finish(ready)
        return future

    def _when_settled(self, work: Callable[[], Any]) -> Future:
        future: Future = Future()
        self.queue.append((work, future))
        return future

    def _drain(self) -> list[tuple[Future, Any, BaseException | None]]:
        """Run the queued reads if no step is half collected; their futures and outcomes
        (set by the caller, outside the lock: a future's callbacks send RPC replies)."""
        if self.collected:
            return []
        done = [_outcome(work, future) for work, future in self.queue]
        self.queue.clear()
        return done

    def _collect(self, trainer: str, grads: torch.Tensor, dense: torch.Tensor | None) -> None:
        lookup = self.kept.pop(trainer, None)
        if lookup is None or trainer in self.collected:
            raise RuntimeError(
                f"ps{self.index}: gradients from {trainer} without a lookup of"
                " its own awaiting them"
            )
        # The reply holds the shards one after another, each's bags (batch, width): a group's
        # part of its gradient is its bags' as the group pooled them (a view, no copy).
        widths = [len(members) * dim for _, dim, members in self.groups]
        batch = grads.numel() // sum(widths)
        self.collected[trainer] = [
            row_gradients(pooled, grad.view(-1, dim))
            for pooled, grad, (_, dim, _) in zip(
                lookup, grads.split([batch * w for w in widths]), self.groups, strict=True
            )
        ]
        if dense is not None:
            self.dense[trainer] = dense
        if len(self.collected) == self.trainers:
            self._step()

    def _step(self) -> None:
        """Step every group once with the trainers' gradients, averaged."""
        for g, weight in enumerate(self.joined):
            # In the trainers' order, not their arrival's: every run adds them up alike.
            parts = [self.collected[t][g] for t in sorted(self.collected)]
            rows = torch.cat([r for r, _ in parts])
            values = torch.cat([v for _, v in parts])
            weight.grad = sparse_optimizers.gradient(rows, values, weight.shape, self.trainers)
            self.rows_updated += weight.grad.indices().shape[1]
        if self.optimizer is not None:
            self.optimizer.step()
        for weight in self.joined:
            weight.grad = None
        if self.dense:  # the trainers' pieces of the dense gradients, averaged alike
            assert len(self.dense) == self.trainers, "every trainer's piece, or none"
            self.dense_mean = sum(self.dense[t] for t in sorted(self.dense)) / self.trainers
        self.collected.clear()
        self.dense.clear()
        self.steps += 1

    def lookup(self, ids: torch.Tensor, lengths: torch.Tensor, trainer: str | None) -> torch.Tensor:
        """Pool `ids` (every shard's local row ids, concatenated, in the server's order) by
        `lengths` (shards, batch); keep the graph for `trainer`'s gradients (None: none).
        The pooled bags, flat, shard after shard (`exchange`): no copy to lay them out."""
        per_piece = lengths.sum(1)
        # Each id as a row of its group's parameter: the shard's row plus the shard's first.
        ids = ids + torch.repeat_interleave(self.first_rows, per_piece)
        one = len(self.groups) == 1  # the usual: no split, no gather, no join
        chunks = [ids] if one else ids.split([int(per_piece[m].sum()) for _, _, m in self.groups])
        outs, kept = [], []
        for (mode, _, members), weight, chunk in zip(self.groups, self.joined, chunks, strict=True):
            counts = (lengths if one else lengths[members]).reshape(-1)
            out, pooled = pool(weight, mode, chunk, counts, trainer is not None)
            outs.append(out.view(-1))  # shard after shard, as it pooled them
            if pooled is not None:
                kept.append(pooled)
        if trainer is not None:
            self.kept[trainer] = kept
        return outs[0] if one else torch.cat(outs)

    # ---- what the master reads

    def rows(self, k: int, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 of shard k (shard-relative), copied."""
        return self.weights[k].detach()[start:stop].clone()

    def figures(self) -> ServerFigures:
        """The squared norms of the tables at initialization and of their change since, and
        the rows this server updated (summed over steps)."""
        tables = {t.name: t for t in self.spec.embeddings}
        initial = change = 0.0
        for p, weight in zip(self.shards, self.weights, strict=True):
            for lo in range(0, p.rows, BLOCK):  # a block at a time: no copy of the table
                hi = min(lo + BLOCK, p.rows)
                made = initial_rows(tables[p.table], self.spec.seed, p.start + lo, p.start + hi)
                start = made[:, p.columns]
                initial += float(start.double().pow(2).sum())
                change += float((weight.detach()[lo:hi] - start).double().pow(2).sum())
        return ServerFigures(
            initialSquares=initial,
            changeSquares=change,
            steps=self.steps,
            rowsUpdated=self.rows_updated,
        )

    # ---- checkpoints: shards by table and row range, so any other split can load them

    def piece_state(self, k: int) -> TorchState:
        """Shard k's optimizer state (torch's, of its group's parameter): its rows of the
        per-row tensors, and the counts."""
        rows = slice(self.first[k], self.first[k] + self.shards[k].rows)
        assert self.optimizer is not None  # a server with a shard has one
        state = self.optimizer.state.get(self.joined[self.group_of[k]], {})
        return {
            key: value[rows] if isinstance(value, torch.Tensor) and value.dim() > 0 else value
            for key, value in state.items()
        }

    def state(self) -> SavedServer:
        """Every shard by table and row range (views of the groups: torch.save writes each
        group's storage once)."""
        shards = [
            SavedShard(
                table=p.table,
                start=p.start,
                stop=p.stop,
                column=p.column,
                weight=weight,
                state=self.piece_state(k),
            )
            for k, (p, weight) in enumerate(zip(self.shards, self.weights, strict=True))
        ]
        return SavedServer(optimizer=self.spec.sparse_optimizer.name, pieces=shards)

    def load(self, saved: list[tuple[str, SavedServer]]) -> None:
        """Load every shard's rows and optimizer state from the saved servers' states
        (`state`, by file name): from whichever hold its rows, however they were split."""
        for name, s in saved:
            if s["optimizer"] != self.spec.sparse_optimizer.name:
                raise checkpoint.CheckpointError(
                    f"{name} holds tables stepped by {s['optimizer']}, not by"
                    f" spec.sparseOptimizer {self.spec.sparse_optimizer.name}"
                )
        for k in range(len(self.shards)):
            self._load_piece(k, saved)

    def _load_piece(self, k: int, saved: list[tuple[str, SavedServer]]) -> None:
        """Shard k's rows and their optimizer state, from every saved shard overlapping it
        (in rows and columns)."""
        p, first, weight = self.shards[k], self.first[k], self.joined[self.group_of[k]]
        assert self.optimizer is not None
        state = self.optimizer.state[weight]
        covered = 0
        for q in (q for _, s in saved for q in s["pieces"]):
            lo, hi = max(p.start, q["start"]), min(p.stop, q["stop"])
            at = q.get("column", 0)  # a checkpoint of before columns: whole rows
            left, right = max(p.column, at), min(p.column + p.dim, at + q["weight"].shape[1])
            if q["table"] != p.table or lo >= hi or left >= right:
                continue
            mine = slice(first + lo - p.start, first + hi - p.start)  # rows of the group's
            theirs = slice(lo - q["start"], hi - q["start"])
            cols = slice(left - p.column, right - p.column)
            their_cols = slice(left - at, right - at)
            with torch.no_grad():
                weight[mine, cols] = q["weight"][theirs, their_cols]
            for key, value in q["state"].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # per row or element
                    if key not in state:
                        state[key] = value.new_zeros((len(weight), *weight.shape[1 : value.dim()]))
                    if value.dim() == 1:
                        state[key][mine] = value[theirs]
                    else:
                        state[key][mine, cols] = value[theirs, their_cols]
                else:  # a count: the same for every shard of every table
                    state[key] = value.clone() if isinstance(value, torch.Tensor) else value
            covered += (hi - lo) * (right - left)
        if covered != p.rows * p.dim:
            raise checkpoint.CheckpointError(
                f"the checkpoint holds {covered} of the {p.rows * p.dim} values of {p.name} of"
                f" table {p.table!r}: not a checkpoint of these tables"
            )


def _outcome(work: Callable[[], Any], future: Future) -> tuple[Future, Any, BaseException | None]:
    """`work` run: (its future, its value, None) or (its future, None, what it raised)."""
    try:
        return future, work(), None
    except BaseException as e:  # the caller's future fails with it, over RPC too
        return future, None, e


def _finish(ready: list[tuple[Future, Any, BaseException | None]]) -> None:
    for future, value, error in ready:
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)


# ---- on the server, over RPC

_SERVER: Server | None = None


def server_names(env: world.Env[HybridSpec]) -> list[str]:
    """The RPC names of the processes that run ps0, ps1, ...: the servers' own, or the
    trainers' (spec.serversInTrainers: trainer i runs ps i)."""
    return env.names("trainer" if env.spec.servers_in_trainers else "ps")


def hosted() -> Server:
    """The parameter server this process runs (a server's, or a trainer's hosting one)."""
    assert _SERVER is not None, "a call for a parameter server reached one not started"
    return _SERVER


def start(trainers: int) -> ServerSize:
    """Runs on a parameter server (the master calls it first): make its shards of the
    tables at their initial rows. Returns what it holds."""
    global _SERVER
    env = world.current()
    _SERVER = Server(env.spec, env.role_index, trainers)
    return ServerSize(
        pieces=len(_SERVER.shards), parameters=sum(w.numel() for w in _SERVER.weights)
    )


@rpc.functions.async_execution
def exchange(
    trainer: str,
    grads: torch.Tensor | None,
    ids: torch.Tensor | None,
    lengths: torch.Tensor | None,
    dense: torch.Tensor | None,
) -> Future:
    return hosted().exchange(trainer, grads, ids, lengths, dense)


@rpc.functions.async_execution
def held_out(ids: torch.Tensor, lengths: torch.Tensor) -> Future:
    """Pooled embeddings for evaluation: no graph kept, nothing stepped."""
    server = hosted()
    return server.read(lambda: server.lookup(ids, lengths, None))


@rpc.functions.async_execution
def save(directory: str) -> Future:
    """Write this server's shards and their optimizer state as ps<index>.pt in `directory`
    (in a trainer's process too); its manifest entry."""
    server = hosted()
    name = f"ps{server.index}.pt"
    return server.read(lambda: checkpoint.save_part(directory, name, server.state()))


def load(directory: str, entries: list[FileEntry]) -> None:
    """Load this server's shards from the servers' files of a checkpoint (`entries`, from
    its manifest), mapped, not read whole: only the rows it holds are paged in."""
    saved = []
    for entry in entries:
        path = Path(directory) / entry["name"]
        if path.stat().st_size != entry["bytes"]:
            raise checkpoint.CheckpointError(f"{path}: not the size its manifest says")
        saved.append((entry["name"], torch.load(path, mmap=True, weights_only=True)))
    hosted().load(saved)


@rpc.functions.async_execution
def rows(k: int, start: int, stop: int) -> Future:
    server = hosted()
    return server.read(lambda: server.rows(k, start, stop))


@rpc.functions.async_execution
def figures() -> Future:
    server = hosted()
    return server.read(server.figures)
