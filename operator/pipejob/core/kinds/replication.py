"""Which of a HybridJob's tables its trainers hold whole: `placement: auto` (the default)
resolved, when the spec is completed, into replicated for a table whose all-reduce moves no
more than its lookups would over RPC (`tables.worth_replicating`), as long as the trainers'
memory limit holds it (smallest first), and into sharded otherwise. The completed spec
carries only the choice, so `pipejob plan`, the validation, the servers and the trainers all
read the same one."""

from __future__ import annotations

from pipejob.core.common_spec import from_spec
from pipejob.core.kind import RawSpec
from pipejob.core.kinds import hybrid_memory, tables

AUTO = "auto"


def choose(spec: RawSpec) -> None:
    """Resolve every table's `auto` placement in the (defaulted) spec, in place."""
    auto = [t for t in spec["embeddings"] if t.get("placement", AUTO) == AUTO]
    if not auto:
        return
    optimizer, room = spec["sparseOptimizer"]["name"], _room(spec)
    for t in auto:
        t["placement"] = "sharded"
    typed = [(t, from_spec(tables.Table, t)) for t in auto]
    for t, table in sorted(
        typed, key=lambda c: (tables.replica_bytes(c[1], optimizer), c[0]["name"])
    ):
        cost = tables.replica_bytes(table, optimizer)
        if tables.worth_replicating(table, spec["batchSize"]) and cost <= room:
            t["placement"] = "replicated"
            room -= cost


def _room(spec: RawSpec) -> float:
    """The bytes a trainer can give tables it replicates by choice: under the pods' memory
    limit, after what it holds besides them and the tables replicated by the spec."""
    try:
        limit = hybrid_memory.memory_limit(spec)
    except ValueError:  # not a quantity: the validation says so
        limit = None
    if limit is None:
        return float("inf")
    optimizer = spec["sparseOptimizer"]["name"]
    given = [
        from_spec(tables.Table, t) for t in spec["embeddings"] if t.get("placement") == "replicated"
    ]
    held = sum(tables.replica_bytes(t, optimizer) for t in given)
    return limit[0] - tables.trainer_needs(hybrid_memory.lanes(spec), held)
