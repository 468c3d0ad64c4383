"""A HybridJob's tables at recommendation scale, piece by piece and in one process: the spec
(tables, servers, field paths), the placement `pipejob plan` prints, the servers' sparse
updates against one nn.Module for every sparse optimizer and pooling, checkpoints loaded by
another split, Criteo logs, AUC and the trained model's file."""

from __future__ import annotations

import copy
import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import recsys_reference as reference
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from pipejob.core import plan
from pipejob.core import spec as specs
from pipejob.core.kinds import tables
from pipejob.trainer import workloads
from pipejob.trainer.hybrid import model_writer, trainer
from pipejob.trainer.hybrid.dense_step import DenseStep
from pipejob.trainer.hybrid.evaluate import check_dense
from pipejob.trainer.hybrid.pooling import pool, row_gradients
from pipejob.trainer.hybrid.ps import Server
from pipejob.trainer.hybrid.router import Router
from pipejob.trainer.workloads import samples
from pipejob.trainer.workloads.criteo import CriteoLog
from pipejob.trainer.workloads.recsys import DLRM, Recommender, auc, initial_rows

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
DLRM_EXAMPLE = ROOT / "examples" / "dlrm"


def manifest(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": "recsys"},
        "spec": spec,
    }


def parse(**spec: Any) -> Any:
    return specs.parse(manifest(**spec))


TABLES = [
    {"name": "wide", "rows": 1000, "dim": 4},
    {"name": "narrow", "rows": 30, "dim": 4, "mode": "mean", "feature": "wide"},
    {"name": "peak", "rows": 50, "dim": 4, "mode": "max"},
]
# Over four servers each table is over a share (a quarter of all bytes) and 32 columns wide:
# split by columns, 8 each (but for rowwiseAdagrad, by rows); every pooling mode.
COLUMNS = [
    {"name": "wide", "rows": 100, "dim": 32},
    {"name": "narrow", "rows": 90, "dim": 32, "mode": "mean", "feature": "wide"},
    {"name": "peak", "rows": 80, "dim": 32, "mode": "max"},
]


# ---------------------------------------------------------------------------- the spec


def test_the_one_table_form_is_one_table_fed_by_the_bags() -> None:
    job = parse(embedding={"numEmbeddings": 64, "dim": 8, "mode": "max"})
    assert job.spec["embeddings"] == [
        {
            "name": "embedding",
            "rows": 64,
            "dim": 8,
            "mode": "max",
            "feature": "ids",
            "placement": "sharded",
        }
    ]
    s = job.settings
    assert not s.recommends and s.parameter_servers == 1
    assert s.sparse_optimizer.name == "sgd" and s.sparse_optimizer.lr == 0.05  # optimizer.lr
    assert parse().spec["embedding"] == {"numEmbeddings": 100, "dim": 16, "mode": "sum"}


def test_tables_are_completed_with_their_feature_and_the_optimizer_with_its_eps() -> None:
    s = parse(embeddings=TABLES, sparseOptimizer={"name": "adam"}).settings
    assert s.recommends and [t.feature for t in s.embeddings] == ["wide", "wide", "peak"]
    assert (s.sparse_optimizer.eps, s.sparse_optimizer.beta2) == (1e-8, 0.999)


@pytest.mark.parametrize(
    ("fields", "path", "said"),
    [
        ({"embeddings": [{"name": "a", "rows": 0, "dim": 4}]}, "spec.embeddings[0].rows", ">= 1"),
        (
            {"embeddings": [{"name": "a", "rows": 9, "dim": 5000}]},
            "spec.embeddings[0].dim",
            "<= 4096",
        ),
        ({"embeddings": [{"name": "a", "dim": 4}]}, "spec.embeddings[0].rows", "is required"),
        (
            {"embeddings": [{"name": "a-b", "rows": 9, "dim": 4}]},
            "spec.embeddings[0].name",
            "Python identifier",
        ),
        (
            {
                "embeddings": [
                    {"name": "a", "rows": 9, "dim": 4},
                    {"name": "a", "rows": 3, "dim": 4},
                ]
            },
            "spec.embeddings[1]",
            "duplicate name 'a'",
        ),
        ({"embeddings": TABLES, "embedding": {"dim": 4}}, "spec.embeddings", "not both"),
        (
            {"embeddings": [TABLES[0], TABLES[1] | {"dim": 8}]},
            "spec.embeddings[1].dim",
            "the built-in DLRM needs every table as wide as the first (4)",
        ),
        (
            {"embeddings": TABLES, "data": {"criteo": {"train": "t.tsv"}}},
            "spec.embeddings[1].feature",
            "'wide' is not a Criteo categorical feature",
        ),
        ({"data": {"criteo": {"train": "t.tsv"}}}, "spec.data.criteo", "needs spec.embeddings"),
        (
            {"embeddings": TABLES, "data": {"file": {"train": "t.npz"}}},
            "spec.data.file",
            "with embeddings use data.criteo or data.import",
        ),
        ({"parameterServers": 65}, "spec.parameterServers", "<= 64"),
        ({"sparseOptimizer": {"name": "rmsprop"}}, "spec.sparseOptimizer.name", "must be one of"),
    ],
)
def test_a_bad_table_spec_is_refused_naming_its_field(fields: dict, path: str, said: str) -> None:
    with pytest.raises(specs.InvalidSpec) as e:
        parse(**fields)
    assert any(err.path == path and said in err.reason for err in e.value.errors), e.value


# ---------------------------------------------------------------------------- placement


def test_a_table_larger_than_a_share_is_split_the_others_placed_by_size() -> None:
    placed = tables.place(
        (
            tables.Table(name="big", rows=10_000, dim=8, feature="big"),
            *(tables.Table(name=f"t{i}", rows=100 * (i + 1), dim=8, feature="f") for i in range(5)),
        ),
        servers=4,
        optimizer="adagrad",
    )
    big = [[(p.start, p.stop) for p in s if p.table == "big"] for s in placed]
    assert big == [[(0, 2500)], [(2500, 5000)], [(5000, 7500)], [(7500, 10_000)]]
    whole = sorted((p.table, p.server) for s in placed for p in s if p.table != "big")
    # Largest first, each to the emptiest server (ties: the lower index).
    assert whole == [("t0", 3), ("t1", 3), ("t2", 2), ("t3", 1), ("t4", 0)]
    loads = [tables.server_bytes(s, "adagrad") for s in placed]
    assert max(loads) - min(loads) <= 500 * tables.row_bytes(8, "adagrad")
    assert tables.row_bytes(16, "rowwiseAdagrad") == 4 * 17
    assert tables.row_bytes(16, "adam") == 4 * 48 and tables.row_bytes(16, "sgd") == 64


def test_a_wide_table_is_split_by_columns_where_its_optimizer_keeps_state_per_element() -> None:
    wide = tables.Table(name="wide", rows=1000, dim=32, feature="wide")
    small = tables.Table(name="small", rows=10, dim=32, feature="wide")
    placed = tables.place((wide, small), servers=2, optimizer="adam")
    assert [[p.name for p in s] for s in placed] == [["wide[:, 0:16]", "small"], ["wide[:, 16:32]"]]
    assert [(p.start, p.stop, p.column, p.dim) for p in placed[1]] == [(0, 1000, 16, 16)]
    # rowwiseAdagrad's state is a mean over each row: split by rows.
    rowwise = tables.place((wide, small), servers=2, optimizer="rowwiseAdagrad")
    assert [[p.name for p in s] for s in rowwise] == [["small", "wide[0:500]"], ["wide[500:1000]"]]
    # Slices under MIN_COLUMNS (4 servers: 8 columns of 32 are the least), or uneven: rows.
    assert tables.by_columns(wide, 4, "adagrad") and not tables.by_columns(wide, 5, "adagrad")
    narrow = tables.Table(name="narrow", rows=1000, dim=8, feature="narrow")
    assert not tables.by_columns(narrow, 2, "sgd")


def test_plan_prints_every_server_s_pieces_and_bytes(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    job = manifest(parameterServers=2, embeddings=TABLES)
    path.write_text(__import__("yaml").safe_dump(job))
    out = subprocess.run(
        [sys.executable, "-m", "pipejob.cli", "plan", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert re.search(r"^\s+1\s+ps0\s+ps\s+0\s+-\s+recsys-ps-0\.recsys$", out, re.M), out
    assert "embedding tables: 3, 17.3 kB of weights + 0 B of sgd state" in out
    # wide is larger than a share (half of all bytes): split; then peak, then narrow.
    assert re.search(r"^ps0\s+8.8 kB\s+wide\[0:500\], peak$", out, re.M), out
    assert re.search(r"^ps1\s+8.5 kB\s+narrow, wide\[500:1000\]$", out, re.M), out
    path.write_text(__import__("yaml").safe_dump(manifest(parameterServers=4, embeddings=COLUMNS)))
    out = subprocess.run(
        [sys.executable, "-m", "pipejob.cli", "plan", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for s, (lo, hi) in enumerate([(0, 8), (8, 16), (16, 24), (24, 32)]):
        named = ", ".join(rf"{t}\[:, {lo}:{hi}\]" for t in ("narrow", "wide", "peak"))
        assert re.search(rf"^ps{s}\s+8.6 kB\s+{named}$", out, re.M), out


def test_a_replicated_table_is_on_no_server_and_the_plan_says_the_trainers_hold_it() -> None:
    replicated = [t | {"placement": "replicated"} if t["name"] != "wide" else t for t in TABLES]
    spec = parse(embeddings=replicated, parameterServers=2).settings
    assert [[p.name for p in s] for s in spec.placement()] == [["wide[0:500]"], ["wide[500:1000]"]]
    assert Router(spec).tables == spec.embeddings[:1]
    lines = tables.placement_lines(spec.embeddings, 2, "sgd")
    assert lines[-1].split() == "trainers 1.3 kB narrow, peak (replicated: each trainer)".split()
    # Every table replicated: the servers hold nothing, and start all the same.
    every = [t | {"placement": "replicated"} for t in TABLES]
    spec = parse(embeddings=every, parameterServers=2).settings
    assert spec.placement() == [[], []] and Router(spec).servers == []
    assert Server(spec, 0, trainers=2).state()["pieces"] == []


def test_auto_placement_replicates_a_table_whose_all_reduce_moves_no_more_than_its_lookups() -> (
    None
):
    """`placement: auto` (the default): replicated where rows x (dim + 1) <= batchSize x dim,
    so a step's all-reduce of the table moves no more than its lookups over RPC; a table
    one row over that, or placed sharded, stays on the servers; `pipejob plan` says which."""
    at_most = 32 * 16 // 17  # 30 rows of dim 16 at batchSize 32 (510 <= 512 floats)
    given = [
        {"name": "big", "rows": 5000, "dim": 16},
        {"name": "edge", "rows": at_most, "dim": 16, "feature": "big"},
        {"name": "over", "rows": at_most + 1, "dim": 16, "feature": "big"},
        {"name": "tiny", "rows": 3, "dim": 16, "placement": "sharded", "feature": "big"},
    ]
    job = parse(embeddings=given, batchSize=32, parameterServers=2)
    placed = {t["name"]: t["placement"] for t in job.spec["embeddings"]}
    assert placed == {"big": "sharded", "edge": "replicated", "over": "sharded", "tiny": "sharded"}
    assert [t.name for t in tables.replicated(job.settings.embeddings)] == ["edge"]
    assert "edge" not in {p.table for s in job.settings.placement() for p in s}
    lines = tables.placement_lines(job.settings.embeddings, 2, "sgd")
    assert lines[-1].split() == "trainers 1.9 kB edge (replicated: each trainer)".split()
    # The completed spec carries the choice: parsed again (as a trainer does), the same.
    again = specs.parse(manifest(**job.spec)).spec["embeddings"]
    assert {t["name"]: t["placement"] for t in again} == placed
    # At a smaller batch the same table's lookups move less than its all-reduce would.
    small = parse(embeddings=given, batchSize=8, parameterServers=2).spec["embeddings"]
    assert {t["placement"] for t in small} == {"sharded"}


def test_auto_placement_replicates_only_what_a_trainer_s_memory_holds_smallest_first() -> None:
    """Under the pods' memory limit a trainer holds torch and its reader first; `auto` then
    replicates the small tables smallest first while the estimate (tables.replica_bytes)
    fits, and leaves the others on the servers, where they fit."""
    limit = tables.trainer_needs(1) + 15_000_000  # room for one of a and b, not both
    given = [
        {"name": "a", "rows": 40_000, "dim": 16, "feature": "C1"},  # 10.9 MB on a trainer
        {"name": "b", "rows": 39_000, "dim": 16, "feature": "C1"},
        {"name": "c", "rows": 60_000, "dim": 16, "feature": "C1"},  # over the batch's bytes
    ]
    costs = [tables.replica_bytes(tables.Table(**t), "sgd") for t in given]
    assert costs[1] < costs[0] < 15_000_000 < costs[0] + costs[1]
    fields = {
        "embeddings": given,
        "batchSize": 50_000,
        "datasetSize": 100_000,
        "parameterServers": 2,
    }
    free = parse(**fields).spec["embeddings"]
    assert [t["placement"] for t in free] == ["replicated", "replicated", "sharded"]
    memory = {"template": {"resources": {"limits": {"memory": str(limit)}}}}
    held = parse(**fields, **memory).spec["embeddings"]
    assert [t["placement"] for t in held] == ["sharded", "replicated", "sharded"]


def test_a_replicated_table_a_trainer_cannot_hold_is_refused_naming_the_room_it_has() -> None:
    """An explicitly replicated table that takes a trainer over the pods' memory limit is
    refused at its placement, saying the room a trainer has (bytes, and rows of its width);
    sharded, its servers hold it."""
    big = {"name": "big", "rows": 5_000_000, "dim": 16, "placement": "replicated"}
    fields = {"sparseOptimizer": {"name": "rowwiseAdagrad"}, "parameterServers": 2}
    memory = {"template": {"resources": {"limits": {"memory": "1500Mi"}}}}
    with pytest.raises(specs.InvalidSpec) as e:
        parse(embeddings=[{"name": "C1", "rows": 100, "dim": 16}, big], **fields, **memory)
    [error] = e.value.errors
    room = 1500 * 2**20 - tables.trainer_needs(1)
    row = tables.replica_bytes(tables.Table(name="big", rows=1, dim=16), "rowwiseAdagrad")
    assert error.path == "spec.embeddings[1].placement"
    assert error.reason == (
        "big is replicated: it costs every trainer about 1.4 GB (its 5,000,000 rows of dim 16,"
        " their rowwiseAdagrad state, a step's gradient and all-reduce), and a trainer would"
        " need about 2.3 GB, over the pods' memory limit 1500Mi"
        " (spec.template.resources.limits.memory): a trainer has room for"
        f" {tables.size(room)} of replicated tables ({room // row:,} rows of dim 16); place"
        " big sharded, on the parameter servers"
    )
    parse(embeddings=[big | {"placement": "sharded"}], **fields, **memory)
    # With room for it, it is replicated: that many rows fit, one more does not.
    fits = big | {"rows": room // row}
    parse(embeddings=[fits], **fields, **memory)
    with pytest.raises(specs.InvalidSpec):
        parse(embeddings=[fits | {"rows": room // row + 1}], **fields, **memory)


def test_servers_over_the_pods_memory_limit_are_refused_saying_how_many_would_do() -> None:
    """A server's estimate counts its tables (a tenth more) and what the process holds
    besides them (tables.PROCESS_BYTES, measured); the advice is the fewest servers whose
    estimate fits, and a limit no count fits asks for more memory, for trainers too."""
    big = [{"name": "big", "rows": 20_000_000, "dim": 16}]  # 1.28 GB of weights
    limited = {"template": {"resources": {"limits": {"memory": "1Gi"}}}}
    with pytest.raises(specs.InvalidSpec) as e:
        parse(embeddings=big, **limited)
    [error] = e.value.errors
    assert error.path == "spec.parameterServers"
    assert error.reason == (
        "ps0 would hold 1.3 GB of tables and sgd state (the largest, spec.embeddings[0]:"
        " 20,000,000 rows of dim 16) and need about 2.3 GB with what the process holds"
        " besides them, over the pods' memory limit 1Gi"
        " (spec.template.resources.limits.memory): use 7 parameterServers (big split by rows,"
        " 2,857,143 at most on each)"
    )
    parse(embeddings=big, parameterServers=7, **limited)
    assert tables.server_needs(tables.fullest(tables_of(big), 7, "sgd")[1]) <= 2**30
    assert tables.server_needs(tables.fullest(tables_of(big), 6, "sgd")[1]) > 2**30
    with pytest.raises(specs.InvalidSpec) as e:
        parse(
            embeddings=big,
            parameterServers=2,
            sparseOptimizer={"name": "rowwiseAdagrad"},
            template={"resources": {"limits": {"memory": "600M"}}},
        )
    assert [(x.path, x.reason.split(": ")[-1]) for x in e.value.errors] == [
        ("spec.template.resources.limits.memory", "give the pods more memory"),
        ("spec.parameterServers", "give the pods more memory"),
    ]
    # A wide table stepped by adam fits split by columns, 8 of its 64 on each of 8 servers.
    wide = [{"name": "wide", "rows": 2_000_000, "dim": 64}]
    with pytest.raises(specs.InvalidSpec) as e:
        parse(embeddings=wide, sparseOptimizer={"name": "adam"}, **limited)
    assert e.value.errors[0].reason.endswith(
        "use 8 parameterServers (wide split by columns, 8 of 64 on each)"
    ), e.value.errors[0].reason
    fits = parse(embeddings=wide, parameterServers=8, sparseOptimizer={"name": "adam"}, **limited)
    assert [p.name for s in fits.settings.placement() for p in s][-1] == "wide[:, 56:64]"


def test_servers_in_the_trainers_are_one_per_trainer_in_its_pod_and_the_plan_says_so(
    tmp_path: Path,
) -> None:
    """spec.serversInTrainers: the world has no servers' processes, needs one server per
    trainer (a number), and counts a server's tables in a trainer's memory."""
    job = parse(embeddings=TABLES, trainers=2, parameterServers=2, serversInTrainers=True)
    assert [m.rpc_name for m in plan.members(job)] == ["master", "trainer0", "trainer1"]
    said = "serversInTrainers runs one parameter server in each trainer"
    for other in ({"parameterServers": 3}, {"trainers": {"min": 1, "max": 2}}):
        with pytest.raises(specs.InvalidSpec) as e:
            parse(
                **{"embeddings": TABLES, "trainers": 2, "parameterServers": 2} | other,
                serversInTrainers=True,
                checkpoint={"path": str(tmp_path)},
            )
        assert [(x.path, x.reason.split(":")[0]) for x in e.value.errors] == [
            ("spec.serversInTrainers", said)
        ], e.value.errors
    inside = manifest(embeddings=TABLES, parameterServers=2, serversInTrainers=True)
    inside["spec"]["sparseOptimizer"] = {"name": "sgd"}
    lines = tables.spec_placement_lines(specs.parse(inside).settings)
    assert lines[1] == "parameter servers: in the trainers' processes, ps<i> in trainer<i>"
    # 1.28 GB of table over two: a server alone fits 1.5Gi, beside a trainer's reader not.
    big = [{"name": "big", "rows": 20_000_000, "dim": 16}]
    limited = {"template": {"resources": {"limits": {"memory": "1.5Gi"}}}}
    parse(embeddings=big, trainers=2, parameterServers=2, **limited)
    with pytest.raises(specs.InvalidSpec) as e:
        parse(embeddings=big, trainers=2, parameterServers=2, serversInTrainers=True, **limited)
    [error] = e.value.errors
    assert error.reason.startswith("ps0 (in trainer0) would hold 640.0 MB"), error.reason
    assert error.reason.endswith(
        "give the pods more memory, or the servers pods of their own (serversInTrainers: false)"
    ), error.reason


def tables_of(specs_: list[dict[str, Any]]) -> tuple[tables.Table, ...]:
    return tuple(tables.Table(**t) for t in specs_)


# ---------------------------------------------------------------------------- the servers


def world(spec: Any, steps: int, trainers: int = 2) -> list[Server]:
    """`steps` steps of `trainers` trainers against the spec's servers, in this process: the
    servers' and the router's own code, without RPC in between."""
    servers = [Server(spec, i, trainers) for i in range(spec.parameter_servers)]
    router = Router(spec)
    data = workloads.hybrid_data(spec)
    torch.manual_seed(spec.seed)
    first = workloads.hybrid_dense(spec, spec.dense_features)
    dense = [first, *(copy.deepcopy(first) for _ in range(trainers - 1))]  # DDP's replicas
    readers = [
        samples.stream(
            data, spec.batch_size * trainers, (k, trainers), spec.seed, router.features, True
        )
        for k in range(trainers)
    ]
    pending: list[list[torch.Tensor | None]] = [[None] * len(servers) for _ in range(trainers)]
    # Each trainer's dense gradients, flat, a piece to each server: they come back averaged.
    dense_pending: list[list[torch.Tensor | None]] = [[None] * len(servers) for _ in pending]
    for _ in range(steps):
        batches = [next(r) for r in readers]
        routed = [router.route(b) for b in batches]
        calls = [
            [
                servers[s].exchange(
                    f"t{k}", pending[k][s], *routed[k].requests[s], dense_pending[k][s]
                )
                for s in router.servers
            ]
            for k in range(trainers)
        ]
        for k in range(trainers):
            got = [c.wait() for c in calls[k]]
            _sgd(dense[k], [mean for _, mean in got], spec.optimizer.lr)
            replies = [pooled.requires_grad_() for pooled, _ in got]
            pooled = router.pool(replies, routed[k], batches[k])
            workloads.loss(spec)(dense[k](batches[k].dense, pooled), batches[k].labels).backward()
            pending[k] = [r.grad for r in replies]
            flat = torch.cat([p.grad.reshape(-1) for p in dense[k].parameters()])
            dense_pending[k] = list(torch.tensor_split(flat, len(router.servers)))
            dense[k].zero_grad(set_to_none=True)
    flushes = [  # every trainer's at once: each waits for the others' dense gradients
        servers[s].exchange(f"t{k}", pending[k][s], None, None, dense_pending[k][s])
        for k in range(trainers)
        for s in router.servers
    ]
    torch.futures.wait_all(flushes)
    return servers


def _sgd(dense: torch.nn.Module, means: list[torch.Tensor | None], lr: float) -> None:
    """An SGD step of `dense` by the servers' pieces of the trainers' averaged gradients
    (none in a step's first calls)."""
    if all(m is None for m in means):
        return
    flat = torch.cat([m for m in means if m is not None])
    params = list(dense.parameters())
    with torch.no_grad():
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p -= lr * g.view_as(p)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwiseAdagrad", "adam"])
def test_servers_step_a_split_table_as_one_module_does_for_every_sparse_optimizer(
    optimizer: str,
) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        spec = parse(
            embeddings=TABLES,
            parameterServers=2,
            trainers=2,
            batchSize=6,
            bagSize=4,
            datasetSize=48,
            denseFeatures=3,
            dense={"dlrm": {"bottom": [5], "top": [6]}},
            sparseOptimizer={"name": optimizer, "lr": 0.1},
            seed=1,
        ).settings
        servers = world(spec, steps=3)
        model, stepped = reference.trained(spec, steps=3)
    finally:
        torch.set_default_dtype(torch.float32)
    assert [p.table for p in spec.placement()[0]] == ["wide", "peak"]  # wide is split in two
    pieces = [piece for s in servers for piece in s.state()["pieces"]]
    for t in spec.embeddings:
        got = reference.assembled(pieces, t.name, t.rows)
        weight = model.tables[t.name].weight
        torch.testing.assert_close(got["weight"], weight.detach(), rtol=1e-12, atol=1e-14)
        for key, value in stepped.state[weight].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-14, msg=key)
    assert all(s.steps == 3 for s in servers)


class Ops(TorchDispatchMode):
    """Counts the torch operations run inside it (below autograd: what a step pays per op)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


MODES = ["sum", "max", "mean"]


@pytest.mark.parametrize("mixed", [False, True], ids=["equal-rows", "mixed-rows"])
def test_a_server_of_whole_tables_gets_its_request_in_as_many_ops_however_many_tables(
    mixed: bool,
) -> None:
    """A trainer routes a step's ids to servers of whole tables (the usual placement) in a
    few ops a server, not a few a table (per-op costs dominate at a batch's few thousand
    ids), wrapping each table's ids by its own rows: the request table by table's."""
    counts = []
    for tables_ in (6, 12):
        spec = parse(
            embeddings=[
                {"name": f"t{i}", "rows": 1000 + 7 * i * mixed, "dim": 4, "mode": MODES[i % 3]}
                for i in range(tables_)
            ],
            parameterServers=2,
            trainers=2,
            batchSize=8,
            bagSize=3,
            datasetSize=32,
        ).settings
        router = Router(spec)
        data = workloads.hybrid_data(spec)
        batch = next(samples.stream(data, 16, (0, 2), 0, router.features, True))
        ids = {f: i * 977 - 5000 for f, i in batch.ids.items()}  # past the rows, and below 0
        batch = dataclasses.replace(batch, ids=ids)
        with Ops() as ops:
            routed = router.route(batch)
        counts.append(ops.count)
        feature = {t.name: t.feature for t in spec.embeddings}
        for requested, pieces in zip(routed.requests, spec.placement(), strict=True):
            assert all(p.whole for p in pieces)
            wrapped = [torch.remainder(batch.ids[feature[p.table]], p.table_rows) for p in pieces]
            assert torch.equal(requested[0], torch.cat(wrapped))
            lengths = [batch.lengths[feature[p.table]] for p in pieces]
            assert torch.equal(requested[1], torch.stack(lengths))
    assert counts[0] == counts[1]


class OpNames(TorchDispatchMode):
    """The names of the torch operations run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_server_s_reply_and_its_gradient_are_the_bags_as_pooled_no_copy() -> None:
    """A server's reply is its shards' pooled bags one shard after another, flat: its lookup
    returns them as it pooled them and takes their gradient's bags as views, with no copy of
    a batch's bags either way; the trainer takes each table's bags as a view of the reply."""
    spec = parse(
        embeddings=[{"name": f"t{i}", "rows": 50 + i, "dim": 4} for i in range(3)],
        parameterServers=1,
        trainers=1,
        batchSize=8,
        bagSize=2,
        datasetSize=32,
    ).settings
    server, router = Server(spec, 0, trainers=1), Router(spec)
    batch = next(samples.stream(workloads.hybrid_data(spec), 8, (0, 1), 0, router.features, True))
    routed = router.route(batch)
    ((ids, lengths),) = routed.requests
    with OpNames() as looked_up:
        reply = server.exchange("t0", None, ids, lengths, None).wait()[0]
    assert reply.shape == (3 * 8 * 4,) and "clone" not in looked_up.names
    pooled = router.pool([reply], routed, batch)
    for k, t in enumerate(spec.embeddings):
        wrapped = torch.remainder(batch.ids[t.feature], t.rows)
        bags = torch.nn.functional.embedding_bag(
            wrapped, server.weights[k], batch.offsets(t.feature), mode="sum"
        )
        assert torch.equal(pooled[t.name], bags)
        assert pooled[t.name].data_ptr() == reply.data_ptr() + k * 8 * 4 * reply.element_size()
    with OpNames() as stepped:
        server.exchange("t0", torch.ones_like(reply), None, None, None).wait()
    assert server.steps == 1 and "clone" not in stepped.names


def test_a_trainer_keeps_the_pairs_it_read_once_each_sorted_without_a_set_a_step() -> None:
    """What a trainer read (for the summary's repeats) is kept as its batches' lists, a
    step's two appends, and made (epoch, sample) pairs once at the end: sorted, once each,
    a sample read again in a later epoch a pair of its own."""
    read = [([0, 0, 0], [5, 1, 5]), ([0, 1], [9, 5]), ([], [])]
    got = trainer._once_each(read)
    assert got.tolist() == [[0, 1], [0, 5], [0, 9], [1, 5]]
    assert trainer._once_each([]).shape == (0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_the_dense_adam_step_on_the_joined_parameters_is_torch_s_to_the_bit(
    name: str, dtype: torch.dtype
) -> None:
    """A trainer steps its dense model's Adam on its parameters joined into one tensor (a
    few ops a step, not a few a parameter), to the same bits as torch's Adam on each, from
    the start and resumed from the state a checkpoint saves (views of the joined moments)."""
    torch.manual_seed(0)
    shapes = [(7, 13), (7,), (1,), (33, 5), (16,)]
    kind = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]

    def made() -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
        torch.manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]
        return params, kind(params, lr=0.01, weight_decay=0.1)

    theirs, torch_adam = made()
    ours, optimizer = made()
    joined = DenseStep(torch.nn.ParameterList(ours), optimizer)
    assert joined.flat is not None
    grads, sizes = torch.Generator().manual_seed(2), [p.numel() for p in ours]
    for step in range(40):
        flat = torch.randn(sum(sizes), generator=grads, dtype=dtype) * 10.0 ** (step % 5 - 3)
        for p, g in zip(theirs, flat.split(sizes), strict=True):
            p.grad = g.view_as(p).clone()
        torch_adam.step()
        if step == 20:  # resumed: a fresh optimizer given the state a checkpoint saved
            saved = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in ours]
            optimizer = kind(ours, lr=0.01, weight_decay=0.1)
            optimizer.state.update(dict(zip(ours, saved, strict=True)))
            joined = DenseStep(torch.nn.ParameterList(ours), optimizer)
        joined.defer(flat)
        joined.flush()
    for mine, torch_s in zip(ours, theirs, strict=True):
        assert torch.equal(mine, torch_s)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[mine][key], torch_adam.state[torch_s][key])


def test_a_summed_lookup_of_one_id_a_bag_hands_each_id_its_bag_s_gradient_as_it_is() -> None:
    """Criteo's features have one id a sample: a server's summed group then keeps no bag
    numbers, and each id's row takes its own place's gradient, as the bags' gather gave it."""
    weight = torch.randn(50, 4)
    ids = torch.tensor([3, 7, 3, 49, 0])
    one, pooled = pool(weight, "sum", ids, torch.ones(5, dtype=torch.int64), keep=True)
    assert pooled is not None and pooled.bags is None
    torch.testing.assert_close(one, weight[ids], rtol=0, atol=0)
    grad = torch.randn(5, 4)
    rows, values = row_gradients(pooled, grad)
    assert torch.equal(rows, ids) and torch.equal(values, grad)
    _, bagged = pool(weight, "sum", ids, torch.tensor([2, 0, 1, 2]), keep=True)
    assert bagged is not None and bagged.bags is not None  # several ids a bag: numbered
    rows, values = row_gradients(bagged, grad[:4])
    assert torch.equal(values, grad[:4][torch.tensor([0, 0, 2, 3, 3])])


def test_the_servers_average_the_dense_gradients_and_let_a_late_first_lookup_through() -> None:
    """The dense model's gradients ride the calls: each trainer's reply brings the trainers'
    average of its piece, once every trainer's piece is in (a flush's too). With no
    all-reduce holding the trainers in step, a trainer's first call can come after another's
    second: it is looked up at once, from the tables as they are, not held behind a step it
    has no gradients in (it would wait for itself)."""
    spec = parse(
        embeddings=TABLES, parameterServers=1, trainers=2, batchSize=4, bagSize=2, datasetSize=16
    ).settings
    server, router = Server(spec, 0, trainers=2), Router(spec)
    data = workloads.hybrid_data(spec)
    batch = next(samples.stream(data, 8, (0, 2), spec.seed, router.features, True))
    ((ids, lengths),) = router.route(batch).requests
    before = server.exchange("t0", None, ids, lengths, None).wait()[0]
    grads = torch.ones_like(before)
    second = server.exchange("t0", grads, ids, lengths, torch.tensor([1.0, 2.0]))
    assert not second.done()  # it reads the tables after the step t1's gradients complete
    late = server.exchange("t1", None, ids, lengths, None)
    assert late.done()
    torch.testing.assert_close(late.wait()[0], before)  # the tables before the step
    assert late.wait()[1] is None  # it brought no dense gradients
    last = server.exchange("t1", grads, ids, lengths, torch.tensor([3.0, 6.0]))
    assert server.steps == 1
    for reply in (second.wait(), last.wait()):
        assert not torch.equal(reply[0], before)  # the stepped tables
        torch.testing.assert_close(reply[1], torch.tensor([2.0, 4.0]))
    flushed = server.exchange("t0", grads, None, None, torch.tensor([1.0, 1.0]))
    assert not flushed.done()  # a flush's average waits for every trainer's piece too
    server.exchange("t1", grads, None, None, torch.tensor([3.0, 5.0])).wait()
    assert flushed.wait()[0] is None
    torch.testing.assert_close(flushed.wait()[1], torch.tensor([2.0, 3.0]))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwiseAdagrad", "adam"])
def test_tables_split_by_columns_step_as_one_module_does(optimizer: str) -> None:
    """Four servers, every table split by columns (by rows for rowwiseAdagrad), two
    trainers, three steps: the tables and their state equal one module's in float64."""
    torch.set_default_dtype(torch.float64)
    try:
        spec = parse(
            embeddings=COLUMNS,
            parameterServers=4,
            trainers=2,
            batchSize=6,
            bagSize=4,
            datasetSize=48,
            denseFeatures=3,
            dense={"dlrm": {"bottom": [5], "top": [6]}},
            sparseOptimizer={"name": optimizer, "lr": 0.1},
            seed=2,
        ).settings
        servers = world(spec, steps=3)
        model, stepped = reference.trained(spec, steps=3)
    finally:
        torch.set_default_dtype(torch.float32)
    split = {p.dim for s in spec.placement() for p in s}
    assert split == ({32} if optimizer == "rowwiseAdagrad" else {8})
    pieces = [piece for s in servers for piece in s.state()["pieces"]]
    for t in spec.embeddings:
        got = reference.assembled(pieces, t.name, t.rows)
        weight = model.tables[t.name].weight
        torch.testing.assert_close(got["weight"], weight.detach(), rtol=1e-12, atol=1e-14)
        for key, value in stepped.state[weight].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-14, msg=key)


@pytest.mark.parametrize(
    ("table_set", "servers", "into"), [(TABLES, 2, (3, 1)), (COLUMNS, 4, (2, 3, 1))]
)
def test_a_checkpoint_of_some_servers_loads_into_others(
    table_set: list[dict[str, Any]], servers: int, into: tuple[int, ...]
) -> None:
    """Pieces are saved by table, row range and columns: any other split of the tables loads
    them (rows into rows; columns into other columns, into rows (3 servers), into one)."""
    saved_spec = parse(
        embeddings=table_set,
        parameterServers=servers,
        sparseOptimizer={"name": "adagrad"},
        datasetSize=32,
        batchSize=4,
    ).settings
    saved = [(f"ps{s.index}.pt", s.state()) for s in world(saved_spec, steps=2)]
    pieces = [p for _, s in saved for p in s["pieces"]]
    for count in into:
        other = parse(
            embeddings=table_set, parameterServers=count, sparseOptimizer={"name": "adagrad"}
        ).settings
        loaded = [Server(other, i, trainers=2) for i in range(count)]
        for server in loaded:
            server.load(saved)
        for server in loaded:
            for k, (p, w) in enumerate(zip(server.shards, server.weights, strict=True)):
                whole = reference.assembled(
                    pieces, p.table, next(t.rows for t in other.embeddings if t.name == p.table)
                )
                torch.testing.assert_close(w.detach(), whole["weight"][p.start : p.stop, p.columns])
                state = server.piece_state(k)
                torch.testing.assert_close(state["sum"], whole["sum"][p.start : p.stop, p.columns])
                assert int(state["step"]) == 2
    other = parse(embeddings=table_set, sparseOptimizer={"name": "sgd"}).settings
    with pytest.raises(RuntimeError, match="stepped by adagrad, not by spec.sparseOptimizer sgd"):
        Server(other, 0, trainers=2).load(saved)


def test_max_and_mean_over_pieces_pool_as_one_embedding_bag() -> None:
    """A split table's bags: some ids in one piece, some in both, some in none."""
    spec = parse(
        embeddings=[
            {"name": "m", "rows": 100, "dim": 3, "mode": "max", "feature": "f"},
            {"name": "a", "rows": 100, "dim": 3, "mode": "mean", "feature": "f"},
        ],
        parameterServers=4,
    ).settings
    servers = [Server(spec, i, 1) for i in range(4)]
    router = Router(spec)
    ids = [[3], [60, 70], [1, 99, 50], [], [26, 27, 80]]
    batch = samples.collate(Bags(ids), list(range(len(ids))), ["f"], True)
    routed = router.route(batch)
    replies = [servers[s].lookup(*routed.requests[i], None) for i, s in enumerate(router.servers)]
    pooled = router.pool(replies, routed, batch)
    for t in spec.embeddings:
        whole = torch.nn.EmbeddingBag(t.rows, t.dim, mode=t.mode)
        whole.weight.data = initial_rows(t, spec.seed, 0, t.rows)
        torch.testing.assert_close(pooled[t.name], whole(batch.ids["f"], batch.offsets("f")))


class Bags:
    def __init__(self, ids: list[list[int]]):
        self.ids = ids
        self.size = len(ids)

    def sample(self, i: int) -> tuple[list[float], dict[str, list[int]], int]:
        return [], {"f": self.ids[i]}, i % 2


def test_initial_rows_are_the_same_whichever_server_makes_them() -> None:
    table = tables.Table(name="t", rows=200_000, dim=2, feature="t")
    whole = initial_rows(table, 7, 0, table.rows)
    assert whole.abs().max() <= 1 / table.rows**0.5
    for start, stop in ((0, 10), (65_530, 65_540), (131_000, 200_000)):
        assert torch.equal(initial_rows(table, 7, start, stop), whole[start:stop])
    assert not torch.equal(initial_rows(table, 8, 0, 10), whole[:10])


# ---------------------------------------------------------------------------- data and figures


def test_the_shipped_click_logs_are_what_their_generator_writes(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(DLRM_EXAMPLE / "make_criteo.py"), "--out", str(tmp_path)],
        check=True,
        timeout=60,
    )
    for name in ("train.tsv", "val.tsv"):
        assert (tmp_path / name).read_bytes() == (DLRM_EXAMPLE / name).read_bytes(), name
    log = CriteoLog(str(DLRM_EXAMPLE / "train.tsv"), "spec.data.criteo.train")
    assert log.size == 1000
    clicks = sum(log.sample(i)[2] for i in range(log.size)) / log.size
    assert 0.15 < clicks < 0.35  # about Criteo's rate


def test_a_criteo_line_reads_as_log_counts_and_hex_values(tmp_path: Path) -> None:
    path = tmp_path / "day.tsv"
    line = ["1", "0", "", "3", "-2", *["7"] * 9, "1a", "", "ff", *["00000001"] * 23]
    path.write_text("\t".join(line) + "\n" + "\t".join(["0", *[""] * 39]))  # no last newline
    log = CriteoLog(str(path), "spec.data.criteo.train")
    assert log.size == 2
    dense, sparse, label = log.sample(0)
    assert label == 1 and dense[:4] == [0.0, 0.0, pytest.approx(1.3862944), 0.0]
    assert sparse["C1"] == [26] and sparse["C2"] == [0] and sparse["C3"] == [255]
    assert sorted(sparse) == sorted(f"C{i}" for i in range(1, 27))
    assert log.sample(1) == ([0.0] * 13, {f"C{i}": [0] for i in range(1, 27)}, 0)
    path.write_text("\t".join(line) + "\n" + "\t".join(["2", *line[1:]]) + "\n")
    with pytest.raises(ValueError, match=rf"^spec.data.criteo.val: {path} line 2: the label is 2"):
        CriteoLog(str(path), "spec.data.criteo.val").sample(1)
    path.write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match=r"line 1: 3 columns, not 40 \(label, I1 ... I13"):
        CriteoLog(str(path), "spec.data.criteo.train")
    with pytest.raises(ValueError, match="no such file"):
        CriteoLog(str(tmp_path / "none.tsv"), "spec.data.criteo.train")


def test_auc_is_the_chance_a_click_outscores_a_non_click() -> None:
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (300,), generator=generator).float()  # many ties
    labels = (torch.rand(300, generator=generator) < 0.3).float()
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).float() + 0.5 * (pos[:, None] == neg[None, :]).float()
    assert auc(scores, labels) == pytest.approx(pairs.double().mean().item(), abs=1e-12)
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([1.0, 1.0])) is None


def test_dlrm_interacts_every_pair_once() -> None:
    torch.manual_seed(0)
    model = DLRM(3, 4, ["a", "b"], bottom=[5], top=[6])
    assert model.top[0].in_features == 4 + 3  # the bottom output and 3 pairs of 3 vectors
    out = model(torch.randn(7, 3), {"a": torch.randn(7, 4), "b": torch.randn(7, 4)})
    assert out.shape == (7,)


@pytest.mark.parametrize(("table_set", "count"), [(TABLES, 2), (COLUMNS, 4)])
def test_the_model_file_holds_every_table_whole_under_its_name(
    tmp_path: Path, table_set: list[dict[str, Any]], count: int
) -> None:
    """Tables split by rows (TABLES) or by columns (COLUMNS) are written whole."""
    spec = parse(
        embeddings=table_set,
        parameterServers=count,
        datasetSize=16,
        batchSize=4,
        denseFeatures=3,
        sparseOptimizer={"name": "adagrad"},
    ).settings
    servers = world(spec, steps=1)
    pieces = [
        (
            p.table,
            p.start,
            p.stop,
            p.column,
            lambda lo, hi, p=p, w=w: w.detach()[lo - p.start : hi - p.start],
        )
        for s in servers
        for p, w in zip(s.shards, s.weights, strict=True)
    ]
    torch.manual_seed(0)
    dense = workloads.hybrid_dense(spec, 3)
    model_spec = model_writer.model_spec(spec)
    for format in ("safetensors", "torch"):
        paths = model_writer.write(
            model_spec,
            tmp_path / format,
            format,
            model_writer.rows_from_shards(pieces),
            dense.state_dict(),
            {"kind": "test"},
        )
        state = (
            load_file(paths[0])
            if format == "safetensors"
            else torch.load(paths[0], weights_only=True)
        )
        model = Recommender(spec.embeddings, workloads.hybrid_dense(spec, 3), 0, True)
        model.load_state_dict(state, strict=True)
        saved = [piece for s in servers for piece in s.state()["pieces"]]
        for t in spec.embeddings:
            split = t.name == "wide" or table_set is COLUMNS  # over a share: a piece a server
            assert len([p for p in saved if p["table"] == t.name]) == (count if split else 1)
            whole = reference.assembled(saved, t.name, t.rows)["weight"]
            assert torch.equal(model.tables[t.name].weight.detach(), whole), t.name
        for name, value in dense.state_dict().items():
            assert torch.equal(model.dense.state_dict()[name], value)
        suffix = ".pt" if format == "torch" else ".safetensors"
        assert [p.name for p in paths] == [f"model{suffix}", "model.json"]


# ---------------------------------------------------------------------------- the user's own


@pytest.fixture
def userpkg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


USER = {
    "embeddings": [{"name": "user", "rows": 50, "dim": 4}, {"name": "item", "rows": 20, "dim": 4}],
    "dense": {
        "import": "userpkg.clicks:Tower",
        "args": {"tables": ["user", "item"], "dim": 4, "dense": 2},
    },
    "data": {"import": "userpkg.clicks:clicks", "args": {"count": 40}},
}


def test_the_user_s_clicks_and_dense_module_are_read_and_checked(userpkg: None) -> None:
    spec = parse(**USER).settings
    train, val = workloads.hybrid_data(spec), workloads.hybrid_held_out(spec)
    assert train.size == val.size == 40 and train.sample(3) != val.sample(3)
    batch = samples.collate(train, list(range(8)), ["item", "user"], True)
    assert batch.dense.shape == (8, 2) and batch.labels.dtype == torch.float32
    assert batch.lengths["item"].tolist() == [1] * 8
    cpu, loss = torch.device("cpu"), workloads.loss(spec)
    check_dense(spec, workloads.hybrid_dense(spec, 2), loss, batch, cpu)
    args = {"tables": ["user", "item"], "dim": 3, "dense": 2}  # a Tower for narrower tables
    narrow = parse(**(USER | {"dense": USER["dense"] | {"args": args}})).settings
    said = (
        "spec.dense.import: the dense module fails on dense features of shape (8, 2) and"
        " pooled embeddings user (8, 4), item (8, 4): RuntimeError: mat1 and mat2"
    )
    with pytest.raises(ValueError, match=re.escape(said)):
        check_dense(spec, workloads.hybrid_dense(narrow, 2), loss, batch, cpu)
    bad = {"import": "userpkg.clicks:clicks", "args": {"count": 40, "bad": 5}}
    broken = workloads.hybrid_data(parse(**(USER | {"data": bad})).settings)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "spec.data.import: item 5 of the train split: feature 'user' has ids [77] outside"
            " 0..49 (the rows of its smallest table)"
        ),
    ):
        broken.sample(5)
    lacking = parse(
        **(
            USER
            | {
                "embeddings": [USER["embeddings"][0] | {"rows": 100}, USER["embeddings"][1]],
                "data": bad,
            }
        )
    ).settings
    with pytest.raises(ValueError, match=r"sample 5 has no ids for feature\(s\) item"):
        samples.collate(workloads.hybrid_data(lacking), [4, 5, 6], ["item", "user"], True)
