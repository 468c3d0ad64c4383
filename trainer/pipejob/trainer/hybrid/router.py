"""Where a trainer's lookups go (`Router.route`: one request per server) and how the replies
join into each table's pooled embeddings (`Router.pool`), from the placement
(core/kinds/tables.py) every process computes alike. docs/architecture.md, "A HybridJob's
step", says how a split table pools."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.core.kinds.tables import Piece, sharded
from pipejob.trainer.workloads.samples import Batch


@dataclass(frozen=True)
class Place:
    """Where a piece's pooled embeddings are in a reply: the server and the columns."""

    piece: Piece
    server: int  # index into Router.servers
    position: int  # among the server's pieces
    column: int


@dataclass(frozen=True)
class Routed:
    requests: list[tuple[torch.Tensor, torch.Tensor]]  # per server: (ids, lengths (pieces, batch))
    counts: dict[tuple[str, int], torch.Tensor]  # (table, piece start) -> ids per sample


class Router:
    def __init__(self, spec: HybridSpec):
        placement = spec.placement()
        self.tables = sharded(spec.embeddings)  # the replicated ones are the trainer's own
        # Servers holding no piece (more servers than rows to split) get no calls.
        self.servers = [i for i, pieces in enumerate(placement) if pieces]
        self.places: dict[str, list[Place]] = {t.name: [] for t in self.tables}
        self.held = [len(placement[index]) for index in self.servers]  # pieces per server
        self.widths = [[p.dim for p in placement[index]] for index in self.servers]
        for s, index in enumerate(self.servers):
            column = 0
            for position, piece in enumerate(placement[index]):
                self.places[piece.table].append(Place(piece, s, position, column))
                column += piece.dim
        for places in self.places.values():
            places.sort(key=lambda p: (p.piece.start, p.piece.column))
        self.features = sorted({t.feature for t in spec.embeddings})  # what the reader reads

    def route(self, batch: Batch) -> Routed:
        per_server: list[list[tuple[torch.Tensor, torch.Tensor]]] = [
            [(torch.empty(0), torch.empty(0))] * held for held in self.held
        ]
        counts = {}
        size = len(batch.sample_ids)
        for table in self.tables:
            ids = torch.remainder(batch.ids[table.feature], table.rows)
            lengths = batch.lengths[table.feature]
            owner = None
            for place in self.places[table.name]:
                piece = place.piece
                if piece.whole:
                    local, count = ids, lengths
                else:
                    if owner is None:  # which sample each id belongs to
                        owner = torch.repeat_interleave(torch.arange(size), lengths)
                    inside = (ids >= piece.start) & (ids < piece.stop)
                    local = ids[inside] - piece.start
                    count = torch.bincount(owner[inside], minlength=size)
                per_server[place.server][place.position] = (local, count)
                counts[(table.name, piece.start)] = count
        requests = [
            (torch.cat([local for local, _ in got]), torch.stack([c for _, c in got]))
            for got in per_server
        ]
        return Routed(requests, counts)

    def pool(
        self, replies: list[torch.Tensor], routed: Routed, batch: Batch
    ) -> dict[str, torch.Tensor]:
        """Each table's pooled embeddings (batch, dim) from the servers' replies."""
        out = {}
        # One split a reply, not a slice a piece: its backward is one cat, where every
        # slice's would fill a reply-sized gradient and add them up.
        split = [
            reply.split(widths, dim=1) for reply, widths in zip(replies, self.widths, strict=True)
        ]
        for table in self.tables:
            places = self.places[table.name]
            parts = [split[p.server][p.position] for p in places]
            if places[0].piece.dim < table.dim:  # split by columns: each piece pools its own
                pooled = torch.cat(parts, dim=1)
            elif table.mode == "max" and len(parts) > 1:
                got = [routed.counts[(table.name, p.piece.start)] > 0 for p in places]
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
        return out
