"""Whether a HybridJob's processes fit their pods' memory limit: a parameter server's tables and
their optimizer state, or a trainer's reader and replicated tables, plus what a process holds
besides them (the figures are in core/kinds/tables.py). A world that would be killed is
refused now, saying how many parameter servers would do, or what room a trainer has for
replicated tables."""

from __future__ import annotations

from dataclasses import replace

from pipejob.core import k8s
from pipejob.core.elastic import Size
from pipejob.core.errors import SpecError
from pipejob.core.kind import RawSpec
from pipejob.core.kinds import tables
from pipejob.core.kinds.tables import MAX_SERVERS, Table


def memory_limit(spec: RawSpec) -> tuple[int, str] | None:
    """The pods' memory limit in bytes, and where it is said; None without one."""
    resources = (spec.get("template") or {}).get("resources") or {}
    limit = (resources.get("limits") or {}).get("memory")
    if limit is None:
        return None
    return int(k8s.quantity(limit)), (
        f"the pods' memory limit {limit} (spec.template.resources.limits.memory)"
    )


def memory_errors(spec: RawSpec) -> list[SpecError]:
    """A trainer, then a parameter server, that would pass the pods' memory limit."""
    limit = memory_limit(spec)
    if limit is None:
        return []
    fits, where = limit
    return _trainer_errors(spec, fits, where) + _server_errors(spec, fits, where)


def lanes(spec: RawSpec) -> int:
    """The lanes of click logs a trainer reads at the fewest trainers."""
    trainers = Size.parse(spec["trainers"])
    return -(-trainers.max // trainers.min)


def replicas(spec: RawSpec) -> list[tuple[int, Table]]:
    """The replicated tables, by their index in spec.embeddings."""
    return [(i, t) for i, t in enumerate(tables.spec_tables(spec)) if t.replicated]


def _trainer_errors(spec: RawSpec, fits: int, where: str) -> list[SpecError]:
    optimizer, copies = spec["sparseOptimizer"]["name"], replicas(spec)
    held = sum(tables.replica_bytes(t, optimizer) for _, t in copies)
    trainer = tables.trainer_needs(lanes(spec), held)
    if trainer <= fits:
        return []
    bare = tables.trainer_needs(lanes(spec))
    if copies and bare <= fits:  # the replicated tables are what does not fit
        return [_replica_error(spec, copies, trainer, fits - bare, where)]
    return [
        SpecError(
            "spec.template.resources.limits.memory",
            (
                f"a trainer needs about {tables.size(trainer)} (torch, RPC, the dense model"
                f" and its reader{_lanes_said(spec)}{', its replicated tables' if copies else ''}),"
                f" over {where}: give the pods more memory"
            ),
        )
    ]


def _lanes_said(spec: RawSpec) -> str:
    """What the reader holds where spec.trainers' range gives a trainer more than one lane."""
    n = lanes(spec)
    return f" of {n} lanes: spec.trainers max over min" if n > 1 else ""


def _replica_error(
    spec: RawSpec, copies: list[tuple[int, Table]], trainer: int, room: int, where: str
) -> SpecError:
    """The largest replicated table, refused for passing a trainer's memory: what a trainer
    has room for, in bytes and in rows of the table's width."""
    optimizer = spec["sparseOptimizer"]["name"]
    i, big = max(copies, key=lambda c: (tables.replica_bytes(c[1], optimizer), -c[0]))
    one_row = tables.replica_bytes(replace(big, rows=1), optimizer)
    return SpecError(
        f"spec.embeddings[{i}].placement",
        (
            f"{big.name} is replicated: it costs every trainer about"
            f" {tables.size(tables.replica_bytes(big, optimizer))} (its {big.rows:,} rows of"
            f" dim {big.dim}, their {optimizer} state, a step's gradient and all-reduce), and"
            f" a trainer would need about {tables.size(trainer)}, over {where}: a trainer has"
            f" room for {tables.size(room)} of replicated tables ({room // one_row:,} rows of"
            f" dim {big.dim}); place {big.name} sharded, on the parameter servers"
        ),
    )


def _server_errors(spec: RawSpec, fits: int, where: str) -> list[SpecError]:
    servers = spec["parameterServers"]
    optimizer, typed = spec["sparseOptimizer"]["name"], tables.spec_tables(spec)
    in_trainers, extra = bool(spec.get("serversInTrainers")), 0
    if in_trainers:  # the trainer's reader and replicated tables share the process
        copies = sum(tables.replica_bytes(t, optimizer) for _, t in replicas(spec))
        extra = tables.trainer_needs(lanes(spec), copies) - tables.PROCESS_BYTES
        fits -= extra
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
    if in_trainers:  # its count is the trainers'
        advice += ", or the servers pods of their own (serversInTrainers: false)"
    elif enough:
        advice = f"use {enough} parameterServers ({_split_at(typed, enough, optimizer)})"
    return [
        SpecError(
            "spec.parameterServers",
            (
                f"ps{server}{f' (in trainer{server})' if in_trainers else ''} would hold"
                f" {tables.size(held)} of tables and {optimizer} state"
                f" ({_largest_table(spec, typed, optimizer)}) and need about"
                f" {tables.size(tables.server_needs(held) + extra)} with what the process"
                f" holds besides them, over {where}: {advice}"
            ),
        )
    ]


def _largest_table(spec: RawSpec, typed: tuple[Table, ...], optimizer: str) -> str:
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
