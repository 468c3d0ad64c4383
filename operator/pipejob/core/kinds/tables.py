"""A HybridJob's embedding tables on its parameter servers: what each row costs, and where
every table goes (the placement), torch-free and pure: `pipejob plan` prints it, the
validation checks it against the pods' memory limit, and every parameter server and trainer
computes the same one. A table over a server's share is split by columns where it is wide
and its optimizer's state is per element (`by_columns`), else by rows. The rule:
docs/architecture.md, "The spec and its validation"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipejob.core.common_spec import from_spec
from pipejob.core.kind import RawSpec
from pipejob.core.schema import Field, Rule

if TYPE_CHECKING:  # hybrid.py declares the kind from these tables
    from pipejob.core.kinds.hybrid import HybridSpec

MAX_SERVERS = 64  # spec.parameterServers at the most
FLOAT_BYTES = 4  # tables and their optimizer state are float32

# What a HybridJob process holds besides its tables, for the plan's memory advice: measured
# peaks of 724-798 MB of a parameter server with a tiny table and 726-798 MB of a trainer
# (torch 2.13.0+cu130 alone is 502 MB resident; then RPC, gloo, TensorPipe's buffers, the
# dense model and its reader), alike under tcmalloc and glibc: 850 MB counts a margin. A
# server's tables count a tenth more than their bytes (a 100 MB table raised a server's peak
# by 106 MB). Measured with docs/user-guide.md's commands (HybridJob memory).
PROCESS_BYTES = 850_000_000
TABLE_MARGIN = 0.1
READER_BYTES = 64_000_000  # a trainer's reader of click logs, per lane it reads

# Floats of optimizer state per row of a table of width `dim`, by sparse optimizer.
STATE_FLOATS = {
    "sgd": lambda dim: 0,
    "adagrad": lambda dim: dim,  # the sum of squared gradients, per element
    "rowwiseAdagrad": lambda dim: 1,  # its mean over the row, one per row
    "adam": lambda dim: 2 * dim,  # both moments, per element (one per table, not per trainer)
}

SERVERS_IN_TRAINERS = Field(
    "boolean",
    "Run the parameter servers inside the trainers' processes, one in each (parameterServers"
    " must equal trainers, a number): a trainer's call to its own server crosses no process,"
    " and the servers have no pods of their own (their memory counts in the trainers' pods).",
    default=False,
)
SERVERS_IN_TRAINERS_RULE = Rule(
    "!self.serversInTrainers || (type(self.trainers) == int &&"
    " self.parameterServers == self.trainers)",
    "serversInTrainers runs one parameter server in each trainer: trainers must be a number"
    " (not elastic) and parameterServers equal to it",
    "serversInTrainers",
    lambda s: (
        not s.get("serversInTrainers")
        or (isinstance(s["trainers"], int) and s["parameterServers"] == s["trainers"])
    ),
)


PLACEMENT = Field(
    "string",
    "Where the table lives: sharded, on the parameter servers (split by rows or columns"
    " where it is over a server's share); replicated, whole on every trainer, looked up"
    " there with no RPC and stepped by the sparse optimizer on every trainer with the"
    " trainers' averaged gradients (for a small table: it costs every trainer its bytes);"
    " or auto: replicated where the table's all-reduce moves no more than its lookups would"
    " over RPC (rows x (dim + 1) <= batchSize x dim) and the trainers' memory limit holds"
    " it, else sharded (`pipejob plan` shows the choice).",
    default="auto",
    enum=("auto", "sharded", "replicated"),
)


@dataclass(frozen=True, kw_only=True)
class Table:
    """One table of spec.embeddings: `rows` x `dim`, pooled by `mode` over the ids of
    `feature` (its name unless given)."""

    name: str
    rows: int
    dim: int
    mode: str = "sum"
    feature: str = ""  # a completed spec always has it (the kind fills in the name)
    placement: str = "sharded"  # or "replicated": on every trainer, no server (a completed
    # spec's: core/kinds/replication.py resolves "auto" into one of them)

    @property
    def replicated(self) -> bool:
        return self.placement == "replicated"


@dataclass(frozen=True)
class Shard:
    """Rows start..stop-1 of a table, columns column..column+dim-1 of them, held by
    parameter server `server`."""

    table: str
    server: int
    start: int
    stop: int
    dim: int  # the shard's columns
    mode: str
    table_rows: int  # rows of the whole table
    column: int = 0  # its first column in the table's
    table_dim: int = 0  # columns of the whole table (0: dim, the shard's)

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        """Whether it holds every row (every id of the table's feature comes to it)."""
        return self.start == 0 and self.stop == self.table_rows

    @property
    def columns(self) -> slice:
        return slice(self.column, self.column + self.dim)

    @property
    def name(self) -> str:
        """As the plan prints it: `big`, `big[0:500]` (rows), `wide[:, 0:32]` (columns)."""
        if 0 < self.table_dim != self.dim:
            return f"{self.table}[:, {self.column}:{self.column + self.dim}]"
        return self.table if self.whole else f"{self.table}[{self.start}:{self.stop}]"


def spec_tables(spec: RawSpec) -> tuple[Table, ...]:
    """A completed spec's spec.embeddings as `Table`s, while the parser checks it (past it,
    HybridSpec.embeddings)."""
    return tuple(from_spec(Table, t) for t in spec["embeddings"])


def row_bytes(dim: int, optimizer: str) -> int:
    """Bytes one row of a table of width `dim` takes on its server, with its optimizer state."""
    return FLOAT_BYTES * (dim + STATE_FLOATS[optimizer](dim))


def table_bytes(table: Table, optimizer: str) -> int:
    return table.rows * row_bytes(table.dim, optimizer)


# A table split by columns gives each server this many columns at the least: narrower
# slices would send every id to every server for little memory each.
MIN_COLUMNS = 8


def by_columns(table: Table, count: int, optimizer: str) -> bool:
    """Whether a table split over `count` servers is split by columns (TorchRec's column-wise
    sharding): every server then holds every row, so a row hot in the data (an empty field's
    row 0) loads them alike, and each reply is narrower. Only where the width splits evenly
    into slices of MIN_COLUMNS or more, and the optimizer's state is per element
    (rowwiseAdagrad's per-row mean would become a mean over each slice)."""
    even = table.dim % count == 0 and table.dim >= MIN_COLUMNS * count
    return even and optimizer != "rowwiseAdagrad"


def place(tables: tuple[Table, ...], servers: int, optimizer: str) -> list[list[Shard]]:
    """Every server's shards (see the module's docstring), server 0 first; a replicated
    table is on none (the trainers hold it)."""
    tables = sharded(tables)
    total = sum(table_bytes(t, optimizer) for t in tables)
    share = total / servers
    held = [[] for _ in range(servers)]  # type: list[list[Shard]]
    load = [0] * servers
    whole = []
    for t in tables:
        if servers > 1 and table_bytes(t, optimizer) > share:
            for shard in _split(t, servers, optimizer, load):
                held[shard.server].append(shard)
        else:
            whole.append(t)
    for t in sorted(whole, key=lambda t: (-table_bytes(t, optimizer), t.name)):
        server = _least_loaded(load)
        held[server].append(Shard(t.name, server, 0, t.rows, t.dim, t.mode, t.rows))
        load[server] += table_bytes(t, optimizer)
    return [ordered(shards) for shards in held]


def sharded(tables: tuple[Table, ...]) -> tuple[Table, ...]:
    """The tables the servers hold: all but the replicated ones."""
    return tuple(t for t in tables if not t.replicated)


def replicated(tables: tuple[Table, ...]) -> tuple[Table, ...]:
    """The tables every trainer holds whole (embeddings[].placement: replicated): a small
    table looked up with no RPC and stepped on every trainer with the trainers' averaged
    gradients, as TorchRec's data-parallel tables are."""
    return tuple(t for t in tables if t.replicated)


def _split(t: Table, servers: int, optimizer: str, load: list[int]) -> list[Shard]:
    """A table over a share, split over the servers by columns or by rows (`by_columns`);
    `load` (each server's bytes) counts the shards."""
    if by_columns(t, servers, optimizer):
        width = t.dim // servers
        shards = [
            Shard(t.name, i, 0, t.rows, width, t.mode, t.rows, i * width, t.dim)
            for i in range(servers)
        ]
        for shard in shards:
            load[shard.server] += shard.rows * row_bytes(width, optimizer)
        return shards
    count = min(servers, t.rows)  # a row is never split
    shards = []
    for i in range(count):
        server = i if count == servers else _least_loaded(load)
        start, stop = i * t.rows // count, (i + 1) * t.rows // count
        shards.append(Shard(t.name, server, start, stop, t.dim, t.mode, t.rows))
        load[server] += (stop - start) * row_bytes(t.dim, optimizer)
    return shards


def _least_loaded(load: list[int]) -> int:
    return min(range(len(load)), key=lambda s: (load[s], s))


def ordered(shards: list[Shard]) -> list[Shard]:
    """A server's shards in the order its replies carry them: summed ones (sum and mean)
    before max ones, then by width and name, so shards pooled alike sit side by side."""
    return sorted(shards, key=lambda p: (p.mode == "max", p.dim, p.table, p.start, p.column))


def server_bytes(shards: list[Shard], optimizer: str) -> int:
    return sum(p.rows * row_bytes(p.dim, optimizer) for p in shards)


def fullest(tables: tuple[Table, ...], servers: int, optimizer: str) -> tuple[int, int]:
    """The server the placement gives the most bytes, and its bytes."""
    held = [server_bytes(shards, optimizer) for shards in place(tables, servers, optimizer)]
    return held.index(max(held)), max(held)


def server_needs(held: int) -> int:
    """The resident memory a parameter server holding `held` bytes of tables and optimizer
    state peaks under, with the margins above."""
    return int(held * (1 + TABLE_MARGIN)) + PROCESS_BYTES


def trainer_needs(lanes: int, replicas: int = 0) -> int:
    """The resident memory a trainer reading `lanes` lanes of click logs and holding
    `replicas` bytes of replicated tables (`replica_bytes`) peaks under."""
    return PROCESS_BYTES + lanes * READER_BYTES + replicas


# A replicated table on a trainer holds its weights and optimizer state, and in a step its
# dense gradient, the all-reduce's flat copy of it and the sparse step's temporaries, and
# its rows' counts. Measured peaks over the process's own (a 2,000,000 x 16 table, 128 MB of
# weights): 3.6x the weights under sgd, 3.7x under rowwiseAdagrad, 5.4x under adam; this
# counts 4.3x, 4.3x and 6.3x (docs/user-guide.md, "Replicated tables").
REPLICA_WEIGHTS = 3  # copies of the weights a step makes, over the table's own bytes
COUNT_BYTES = 16  # a row's counts: int64 from bincount, then as a float in the all-reduce


def replica_bytes(table: Table, optimizer: str) -> int:
    """Bytes a replicated table costs every trainer at a step's peak."""
    weights = table.rows * table.dim * FLOAT_BYTES
    return table_bytes(table, optimizer) + REPLICA_WEIGHTS * weights + COUNT_BYTES * table.rows


def worth_replicating(table: Table, batch: int) -> bool:
    """Whether `placement: auto` replicates the table, memory allowing: its all-reduce (a
    step's gradient of every row and its count, rows x (dim + 1) floats) moves no more than
    its lookups would over RPC on a trainer of `batch` samples (the pooled rows out and
    their gradients back, 2 x batch x dim floats; a ring all-reduce moves twice its size)."""
    return table.rows * (table.dim + 1) <= batch * table.dim


def spec_placement_lines(settings: HybridSpec) -> list[str]:
    """`pipejob plan`'s lines on a HybridJob's tables."""
    return placement_lines(
        settings.embeddings,
        settings.parameter_servers,
        settings.sparse_optimizer.name,
        settings.servers_in_trainers,
    )


def placement_lines(
    tables: tuple[Table, ...], servers: int, optimizer: str, in_trainers: bool = False
) -> list[str]:
    """The tables' bytes, and each server's shards (`big[0:500000], c2`), as words;
    `in_trainers`: the servers run in the trainers' processes (spec.serversInTrainers)."""
    weights = sum(t.rows * t.dim * FLOAT_BYTES for t in tables)
    state = sum(table_bytes(t, optimizer) for t in tables) - weights
    out = [
        f"embedding tables: {len(tables)}, {size(weights)} of weights + {size(state)} of"
        f" {optimizer} state",
        f"{'server':<8} {'bytes':>12}  tables (rows start:stop, or [:, columns], where split)",
    ]
    if in_trainers:
        out.insert(1, "parameter servers: in the trainers' processes, ps<i> in trainer<i>")
    for s, shards in enumerate(place(tables, servers, optimizer)):
        named = ", ".join(p.name for p in shards)
        out.append(f"{f'ps{s}':<8} {size(server_bytes(shards, optimizer)):>12}  {named or '-'}")
    if copies := replicated(tables):
        held = sum(table_bytes(t, optimizer) for t in copies)
        named = ", ".join(t.name for t in copies)
        out.append(f"{'trainers':<8} {size(held):>12}  {named} (replicated: each trainer)")
    return out


def size(n: int) -> str:
    """Bytes in words: 512 B, 6.4 kB, 1.5 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"
