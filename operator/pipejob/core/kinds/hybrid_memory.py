"""Whether a HybridJob's processes fit their pods' memory limit: a parameter server's tables and
their optimizer state, or a trainer's reader, plus what a process holds besides them (the
figures are in core/kinds/tables.py). A world that would be killed is refused now, saying
how many parameter servers would do."""

from __future__ import annotations

from pipejob.core import k8s
from pipejob.core.elastic import Size
from pipejob.core.errors import SpecError
from pipejob.core.kind import Spec
from pipejob.core.kinds import tables
from pipejob.core.kinds.tables import MAX_SERVERS, Table


def memory_errors(spec: Spec) -> list[SpecError]:
    """A trainer, then a parameter server, that would pass the pods' memory limit."""
    resources = (spec.get("template") or {}).get("resources") or {}
    limit = (resources.get("limits") or {}).get("memory")
    if limit is None:
        return []
    fits = int(k8s.quantity(limit))
    where = f"the pods' memory limit {limit} (spec.template.resources.limits.memory)"
    return _trainer_errors(spec, fits, where) + _server_errors(spec, fits, where)


def _trainer_errors(spec: Spec, fits: int, where: str) -> list[SpecError]:
    trainers = Size.parse(spec["trainers"])
    trainer = tables.trainer_needs(-(-trainers.max // trainers.min))  # its lanes at the fewest
    if trainer <= fits:
        return []
    return [
        SpecError(
            "spec.template.resources.limits.memory",
            (
                f"a trainer needs about {tables.size(trainer)} (torch, RPC, the dense model"
                f" and its reader), over {where}: give the pods more memory"
            ),
        )
    ]


def _server_errors(spec: Spec, fits: int, where: str) -> list[SpecError]:
    servers = spec["parameterServers"]
    optimizer, typed = spec["sparseOptimizer"]["name"], tables.spec_tables(spec)
    server, held = tables.fullest(typed, servers, optimizer)
    if tables.server_needs(held) <= fits:
        return []
    enough = next(
        (
            n
            for n in range(servers + 1, MAX_SERVERS + 1)
            if tables.server_needs(tables.fullest(typed, n, optimizer)[1]) <= fits
        ),
        None,
    )
    advice = "give the pods more memory"
    if enough:
        advice = f"use {enough} parameterServers ({_split_at(typed, enough, optimizer)})"
    return [
        SpecError(
            "spec.parameterServers",
            (
                f"ps{server} would hold {tables.size(held)} of tables and {optimizer} state"
                f" ({_largest_table(spec, typed, optimizer)}) and need about"
                f" {tables.size(tables.server_needs(held))} with what the process holds besides"
                f" them, over {where}: {advice}"
            ),
        )
    ]


def _largest_table(spec: Spec, typed: tuple[Table, ...], optimizer: str) -> str:
    """The table that weighs most, by its field path: what a memory refusal is most about."""
    i = max(range(len(typed)), key=lambda k: tables.table_bytes(typed[k], optimizer))
    where = "spec.embedding" if "embedding" in spec else f"spec.embeddings[{i}]"
    return f"the largest, {where}: {typed[i].rows:,} rows of dim {typed[i].dim}"


def _split_at(typed: tuple[Table, ...], servers: int, optimizer: str) -> str:
    """How the largest table is placed on `servers` servers: whole, by columns or by rows."""
    largest = max(typed, key=lambda t: tables.table_bytes(t, optimizer))
    placed = tables.place(typed, servers, optimizer)
    pieces = [p for held in placed for p in held if p.table == largest.name]
    if len(pieces) == 1:
        return f"{largest.name} whole on one"
    if pieces[0].dim < largest.dim:
        return f"{largest.name} split by columns, {pieces[0].dim} of {largest.dim} on each"
    return f"{largest.name} split by rows, {max(p.rows for p in pieces):,} at most on each"
