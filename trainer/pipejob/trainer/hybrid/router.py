"""Where a trainer's lookups go (`Router.route`: one request per server) and how the replies
join into each table's pooled embeddings (`Router.pool`), from the placement
(core/kinds/tables.py) every process computes alike. docs/architecture.md, "A HybridJob's
step", says how a split table pools."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.core.kinds.tables import Shard, sharded
from pipejob.trainer.workloads.samples import Batch


@dataclass(frozen=True)
class Place:
    """Where a shard's pooled embeddings are in a reply: the server and the columns."""

    shard: Shard
    server: int  # index into Router.servers
    position: int  # among the server's shards
    column: int


@dataclass(frozen=True)
class Routed:
    requests: list[tuple[torch.Tensor, torch.Tensor]]  # per server: (ids, lengths (shards, batch))
    counts: dict[tuple[str, int], torch.Tensor]  # (table, shard start) -> ids per sample


class Router:
    def __init__(self, spec: HybridSpec):
        placement = spec.placement()
        self.tables = sharded(spec.embeddings)  # the replicated ones are the trainer's own
        self.feature_of = {t.name: t.feature for t in self.tables}
        # Servers holding no shard (more servers than rows to split) get no calls.
        self.servers = [i for i, shards in enumerate(placement) if shards]
        self.places: dict[str, list[Place]] = {t.name: [] for t in self.tables}
        self.held = [len(placement[index]) for index in self.servers]  # shards per server
        # A reply's runs of shards of one width (count, width): each a view of it.
        self.runs = [_runs([p.dim for p in placement[index]]) for index in self.servers]
        for s, index in enumerate(self.servers):
            column = 0
            for position, shard in enumerate(placement[index]):
                self.places[shard.table].append(Place(shard, s, position, column))
                column += shard.dim
        for places in self.places.values():
            places.sort(key=lambda p: (p.shard.start, p.shard.column))
        self.features = sorted({t.feature for t in spec.embeddings})  # what the reader reads
        # A server holding whole tables alone gets its request in a few ops, not a few a
        # table (per-op costs dominate at a batch's few thousand ids): its shards' features,
        # and their tables' rows (one number if they agree) that the ids wrap by.
        self.whole: list[tuple[list[str], torch.Tensor] | None] = []
        for index in self.servers:
            shards = placement[index]
            rows = torch.tensor([p.table_rows for p in shards])
            wrap = rows[:1] if bool((rows == rows[0]).all()) else rows
            features = [self.feature_of[p.table] for p in shards]
            self.whole.append((features, wrap) if all(p.whole for p in shards) else None)
        # A summed or max table on one server is its reply's columns as they are; the others
        # are joined, masked or divided here (`pool`).
        self.alone = {
            t.name: (places[0].server, places[0].position)
            for t in self.tables
            if len(places := self.places[t.name]) == 1 and t.mode != "mean"
        }
        self.pooled_here = [t for t in self.tables if t.name not in self.alone]
        self.on_whole = {  # tables whose every shard is on such a server
            t.name
            for t in self.tables
            if all(self.whole[p.server] is not None for p in self.places[t.name])
        }

    def route(self, batch: Batch) -> Routed:
        """The batch's requests, one a server: (its shards' local ids, concatenated; the ids
        each sample has in each shard (shards, batch))."""
        per_server: list[list[tuple[torch.Tensor, torch.Tensor]]] = [
            [(torch.empty(0), torch.empty(0))] * held for held in self.held
        ]
        counts = {}
        size = len(batch.sample_ids)
        for table in self.tables:
            if table.name in self.on_whole:
                shard = self.places[table.name][0].shard
                counts[(table.name, shard.start)] = batch.lengths[table.feature]
                continue  # its server's request is made whole below
            ids = torch.remainder(batch.ids[table.feature], table.rows)
            lengths = batch.lengths[table.feature]
            owner = None
            for place in self.places[table.name]:
                shard = place.shard
                if shard.whole:
                    local, count = ids, lengths
                else:
                    if owner is None:  # which sample each id belongs to
                        owner = torch.repeat_interleave(torch.arange(size), lengths)
                    inside = (ids >= shard.start) & (ids < shard.stop)
                    local = ids[inside] - shard.start
                    count = torch.bincount(owner[inside], minlength=size)
                per_server[place.server][place.position] = (local, count)
                counts[(table.name, shard.start)] = count
        requests = [
            _whole(batch, *whole)
            if whole is not None
            else (torch.cat([local for local, _ in got]), torch.stack([c for _, c in got]))
            for got, whole in zip(per_server, self.whole, strict=True)
        ]
        return Routed(requests, counts)

    def pool(
        self, replies: list[torch.Tensor], routed: Routed, batch: Batch
    ) -> dict[str, torch.Tensor]:
        """Each table's pooled embeddings (batch, dim) from the servers' replies."""
        out = {}
        split = [_shards(reply, runs) for reply, runs in zip(replies, self.runs, strict=True)]
        for name, (server, position) in self.alone.items():
            out[name] = split[server][position]
        for table in self.pooled_here:
            places = self.places[table.name]
            parts = [split[p.server][p.position] for p in places]
            if places[0].shard.dim < table.dim:  # split by columns: each shard pools its own
                pooled = torch.cat(parts, dim=1)
            elif table.mode == "max" and len(parts) > 1:
                got = [routed.counts[(table.name, p.shard.start)] > 0 for p in places]
                masked = [
                    torch.where(g.unsqueeze(1), part, -torch.inf)
                    for g, part in zip(got, parts, strict=True)
                ]
                pooled = torch.stack(masked).amax(0)
                pooled = torch.where(torch.stack(got).any(0).unsqueeze(1), pooled, 0.0)
            else:
                pooled = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
            if table.mode == "mean":
                length = batch.lengths[table.feature].clamp(min=1).to(pooled.dtype)
                pooled = pooled / length.unsqueeze(1)
            out[table.name] = pooled
        if self.alone and self.pooled_here:  # in the tables' order, as a user's module sees it
            out = {t.name: out[t.name] for t in self.tables}
        return out


def _whole(
    batch: Batch, features: list[str], rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The request of a server of whole tables: every shard's ids wrapped by its table's
    rows (`rows`: one a shard, or one for all), concatenated, and their counts a sample."""
    lengths = torch.stack([batch.lengths[f] for f in features])
    ids = torch.cat([batch.ids[f] for f in features])
    if len(rows) > 1:
        rows = torch.repeat_interleave(rows, lengths.sum(1))
    return torch.remainder(ids, rows), lengths


def _runs(widths: list[int]) -> list[tuple[int, int]]:
    """Runs of equal `widths` (a server's shards'), in order: (shards, width)."""
    runs: list[tuple[int, int]] = []
    for width in widths:
        if runs and runs[-1][1] == width:
            runs[-1] = (runs[-1][0] + 1, width)
        else:
            runs.append((1, width))
    return runs


def _shards(reply: torch.Tensor, runs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """A server's reply (flat: each shard's pooled bags (batch, width) after the last) as
    its shards' (batch, width), views: one unbind a run, whose backward is one stack, where
    a slice a shard would each fill a reply-sized gradient and add them up."""
    batch = reply.numel() // sum(count * width for count, width in runs)
    blocks = [reply] if len(runs) == 1 else reply.split([n * batch * w for n, w in runs])
    return [
        shard
        for block, (count, width) in zip(blocks, runs, strict=True)
        for shard in block.view(count, batch, width).unbind(0)
    ]
