"""HybridJob: embedding tables on parameter servers over RPC, DDP dense layers on trainer
pods, driven by a master. Everything pipejob knows of the kind is declared here, once; where
its tables go is core/kinds/tables.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipejob.core.common_spec import COMMON, COMMON_RULES, CommonSpec
from pipejob.core.data_sources import HYBRID_DATA, HybridData
from pipejob.core.elastic import (
    Size,
    cel_full_size,
    elastic_acts,
    full_size,
    needs_checkpoint,
    size_field,
)
from pipejob.core.errors import shown
from pipejob.core.kind import Kind, ProcessGroup, RawSpec, Role, column
from pipejob.core.kinds import replication, tables
from pipejob.core.kinds.hybrid_memory import memory_errors
from pipejob.core.kinds.sparse import EPS, SPARSE_OPTIMIZER, SparseOptimizer
from pipejob.core.kinds.tables import MAX_SERVERS, SERVERS_IN_TRAINERS, Table
from pipejob.core.schema import Field, Rule, SpecError, apply, integer, integer_list
from pipejob.core.workload import ARGS, args_need_import, import_field

# The samples come from files or the user's code, not from datasetSize and bagSize.
_REAL_DATA = (
    "has(self.data) && (has(self.data.file) || has(self.data.__import__) || has(self.data.criteo))"
)
NAME = r"[A-Za-z_][A-Za-z0-9_]*"
# The one table of spec.embedding, and the feature of the bags that feed it.
ONE_TABLE, BAGS = "embedding", "ids"
# Criteo's columns: 13 integer (dense) features I1..I13, and the categorical ones C1..C26.
CRITEO_DENSE = 13
CRITEO_FEATURES = tuple(f"C{i}" for i in range(1, 27))

EMBEDDING = Field(
    "object",
    "One EmbeddingBag table fed by the bags' ids (synthetic bags, data.file or data.import of"
    " (ids, label) samples), with a classifier on its pooled embedding: short for one"
    " table named `embedding` in spec.embeddings. Give this or embeddings, not both.",
    fields={
        "numEmbeddings": integer("Rows of the table.", default=100, minimum=1),
        "dim": integer("Width of an embedding.", default=16, minimum=1),
        "mode": Field(
            "string", "How a bag is reduced.", default="sum", enum=("sum", "mean", "max")
        ),
    },
    section=True,
)

TABLE = Field(
    "object",
    "One embedding table, pooled over the ids its feature gives each sample.",
    fields={
        "name": Field(
            "string",
            "The table's name: the key of its pooled embeddings and of"
            " its weight in the trained model.",
            pattern=NAME,
            pattern_says="be a Python identifier",
            max_length=63,
        ),
        "rows": integer(
            "Rows of the table. A feature's ids must lie below it; Criteo's"
            " categorical values are hashed into it (value mod rows).",
            minimum=1,
            maximum=2**40,
        ),
        "dim": integer("Width of an embedding.", minimum=1, maximum=4096),
        "mode": Field(
            "string", "How a sample's ids are pooled.", default="sum", enum=("sum", "mean", "max")
        ),
        "feature": Field(
            "string",
            "The input feature whose ids the table looks up (C1 ..."
            " C26 for Criteo data); the table's name unless given. Tables may"
            " share a feature.",
            pattern=NAME,
            pattern_says="be a Python identifier",
            max_length=63,
        ),
        "placement": tables.PLACEMENT,
    },
    required=("name", "rows", "dim"),
)

DLRM = Field(
    "object",
    "The built-in DLRM (with spec.embeddings and no dense.import): a bottom MLP over the dense"
    " features to the tables' width, the pairwise dot products of its output and the pooled"
    " embeddings, and a top MLP over them and the bottom output to one logit (click or not).",
    fields={
        "bottom": integer_list(
            "Hidden widths of the bottom MLP; a last layer to the tables' dim follows.",
            "A width.",
            default=[64],
            max_items=16,
        ),
        "top": integer_list(
            "Hidden widths of the top MLP; a last layer to one logit follows.",
            "A width.",
            default=[64, 32],
            max_items=16,
        ),
    },
)

HYBRID_SPEC = Field(
    "object",
    "A hybrid job: embedding tables on parameter servers over RPC, DDP dense layers on trainers.",
    fields={
        "trainers": size_field(
            "Trainer pods; they form the DDP group.", default=2, minimum=1, maximum=256
        ),
        "parameterServers": integer(
            "Parameter server pods. The tables are placed on them by size; a table larger than"
            " a share (all tables' bytes / parameterServers) is split row-wise across all of"
            " them (`pipejob plan` prints where each goes).",
            default=1,
            minimum=1,
            maximum=MAX_SERVERS,
        ),
        "serversInTrainers": SERVERS_IN_TRAINERS,
        "embedding": EMBEDDING,
        "embeddings": Field(
            "array",
            "The embedding tables (a recommendation model's sparse features): each with its"
            " own rows, width, pooling and feature. With them the model takes dense features"
            " too, and the task is a click (label 0 or 1): the built-in DLRM (dense.dlrm) or"
            " dense.import, binary cross-entropy, and AUC on the held-out data.",
            items=TABLE,
            min_items=1,
            max_items=1024,
            list_map_keys=("name",),
        ),
        "sparseOptimizer": SPARSE_OPTIMIZER,
        "dense": Field(
            "object",
            "The DDP-replicated dense model on every trainer. With spec.embedding: a"
            " Linear layer from the bag's embedding to outFeatures classes, or the user's"
            " module (import) on it. With spec.embeddings: the built-in DLRM (dlrm), or the"
            " user's module (import) called with (dense features (batch, n), {table name:"
            " pooled embeddings (batch, dim)}).",
            fields={
                "outFeatures": integer("Output classes (spec.embedding).", default=8, minimum=2),
                "import": import_field(
                    "a torch.nn.Module taking a batch of bag embeddings (batch, dim) with"
                    " spec.embedding, or (dense features, {table name: pooled embeddings})"
                    " with spec.embeddings"
                ),
                "args": ARGS,
                "dlrm": DLRM,
            },
            rules=(args_need_import("dense"),),
        ),
        "batchSize": integer(
            "Samples per trainer step (at trainers.max when elastic); a step"
            " trains on batchSize x trainers.max.",
            default=32,
            minimum=1,
        ),
        "bagSize": integer("Synthetic data: most ids in one bag.", default=10, minimum=1),
        "datasetSize": integer(
            "Synthetic data: samples, split disjointly across trainers.", default=10000, minimum=1
        ),
        "denseFeatures": integer(
            "Synthetic data with spec.embeddings: dense features per sample.",
            default=13,
            maximum=1024,
        ),
        "data": HYBRID_DATA,
        "gpusPerTrainer": integer(
            "GPUs per trainer pod (nvidia.com/gpu): 0 runs on CPU, 1 on a GPU (a trainer uses"
            " one).",
            default=0,
            maximum=1,
        ),
        "backend": Field(
            "string",
            "DDP backend of the trainers: gloo without GPUs (the default), nccl with.",
            enum=("gloo", "nccl"),
        ),
        **COMMON,
    },
    rules=(
        Rule(
            "!has(self.embedding) || !has(self.embeddings)",
            "give embedding (one table) or embeddings (a list of tables), not both",
            "embeddings",
            lambda s: "embedding" not in s or "embeddings" not in s,
        ),
        Rule(
            "!has(self.embeddings) || !has(self.data) || !has(self.data.file)",
            "data.file holds bags for spec.embedding's one table; with embeddings use"
            " data.criteo or data.import",
            "data.file",
            lambda s: "embeddings" not in s or "file" not in (s.get("data") or {}),
        ),
        Rule(
            "has(self.embeddings) || !has(self.data) || !has(self.data.criteo)",
            "data.criteo needs spec.embeddings: the tables its categorical features C1 ... C26"
            " feed",
            "data.criteo",
            lambda s: "embeddings" in s or "criteo" not in (s.get("data") or {}),
        ),
        Rule(
            "!has(self.backend) || self.backend != 'nccl' || self.gpusPerTrainer > 0",
            "backend nccl needs gpusPerTrainer > 0",
            "backend",
            lambda s: s.get("backend") != "nccl" or s["gpusPerTrainer"] > 0,
        ),
        Rule(
            f"({_REAL_DATA}) || self.datasetSize >= {cel_full_size('trainers')} * self.batchSize",
            "datasetSize must hold at least one batch per trainer (trainers * batchSize)",
            "datasetSize",
            lambda s: (
                _has_real_data(s) or s["datasetSize"] >= full_size(s["trainers"]) * s["batchSize"]
            ),
            message_expression="'datasetSize must hold at least one batch per trainer: ' +"
            " (type(self.trainers) == int ? 'trainers' : 'trainers.max') + ' x batchSize = ' +"
            f" string({cel_full_size('trainers')} * self.batchSize) + ' samples, got ' +"
            " string(self.datasetSize)",
            explain=lambda s: (
                "datasetSize must hold at least one batch per trainer: "
                + ("trainers" if isinstance(s["trainers"], int) else "trainers.max")
                + f" x batchSize = {full_size(s['trainers']) * s['batchSize']} samples, got"
                f" {s['datasetSize']}"
            ),
        ),
        Rule(
            "!has(self.optimizer.schedule) && !has(self.optimizer.clipGradNorm)",
            "a HybridJob has no optimizer.schedule or optimizer.clipGradNorm yet: its parameter"
            " servers step the tables with their own sparse optimizer (sparseOptimizer), so"
            " there is no one step over every parameter to schedule or clip; use a constant lr",
            "optimizer",
            lambda s: "schedule" not in s["optimizer"] and "clipGradNorm" not in s["optimizer"],
        ),
        Rule(
            "!has(self.eval) || (!has(self.eval.best) && !has(self.eval.earlyStopping))",
            "a HybridJob keeps no best model and stops no run early yet: leave eval.best and"
            " eval.earlyStopping out",
            "eval",
            lambda s: not ({"best", "earlyStopping"} & set(s.get("eval", {}))),
        ),
        Rule(
            "!has(self.embeddings) || !has(self.loss) || !has(self.loss.crossEntropy)",
            "a click (spec.embeddings) is judged by binary cross-entropy: loss.crossEntropy's"
            " options are for class labels; leave it out",
            "loss.crossEntropy",
            lambda s: "embeddings" not in s or "crossEntropy" not in s.get("loss", {}),
        ),
        needs_checkpoint("trainers"),
        elastic_acts("trainers"),
        tables.SERVERS_IN_TRAINERS_RULE,
        *COMMON_RULES,
    ),
)


def _has_real_data(spec: RawSpec) -> bool:
    return bool({"file", "import", "criteo"} & set(spec.get("data") or {}))


@dataclass(frozen=True, kw_only=True)
class HybridSpec(CommonSpec):
    trainers: Size  # the world runs at a size the plan gives; the batch is max's
    parameter_servers: int
    servers_in_trainers: bool  # trainer i's process runs ps i
    embeddings: tuple[Table, ...]  # spec.embedding, when given, as its one table
    sparse_optimizer: SparseOptimizer
    dense: Dense
    batch_size: int
    bag_size: int
    dataset_size: int
    dense_features: int
    gpus_per_trainer: int
    backend: str
    embedding: Embedding | None = None  # the one-table form: bags and a classifier
    data: HybridData = HybridData()

    @property
    def recommends(self) -> bool:
        """The model takes dense features and pooled tables and predicts a click (spec.
        embeddings); otherwise it classifies bags of one table (spec.embedding)."""
        return self.embedding is None

    def placement(self) -> list[list[tables.Shard]]:
        """Every parameter server's shards of the tables (core/kinds/tables.py)."""
        return tables.place(self.embeddings, self.parameter_servers, self.sparse_optimizer.name)


@dataclass(frozen=True, kw_only=True)
class Dlrm:
    bottom: tuple[int, ...]
    top: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Dense:
    out_features: int
    dlrm: Dlrm
    import_: str | None = None  # the user's dense module
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Embedding:
    num_embeddings: int
    dim: int
    mode: str


def _completed(spec: RawSpec) -> RawSpec:
    """The DDP backend follows the GPUs unless chosen; spec.embedding (the default) becomes
    its one table in spec.embeddings, fed by the bags' ids; a feature is its table's name unless
    given; the sparse lr and eps filled in; `auto` tables placed (core/kinds/replication.py)."""
    if "backend" not in spec:
        spec["backend"] = "nccl" if spec["gpusPerTrainer"] > 0 else "gloo"
    if "embeddings" not in spec:
        one = spec["embedding"] = apply(EMBEDDING, spec.get("embedding", {}), "", [])
        table = {"name": ONE_TABLE, "rows": one["numEmbeddings"], "dim": one["dim"]}
        spec["embeddings"] = [
            table | {"mode": one["mode"], "feature": BAGS, "placement": tables.PLACEMENT.default}
        ]
    for table in spec["embeddings"]:
        table.setdefault("feature", table["name"])
    sparse = spec["sparseOptimizer"]
    sparse.setdefault("lr", spec["optimizer"]["lr"])
    sparse.setdefault("eps", EPS[sparse["name"]])
    replication.choose(spec)
    return spec


def _spec_errors(spec: RawSpec) -> list[SpecError]:
    """The built-in DLRM's one width, Criteo's feature names, and the servers' memory."""
    errors, embeddings = [], spec["embeddings"]
    if "embedding" not in spec and "import" not in spec["dense"]:  # the built-in DLRM
        dim = embeddings[0]["dim"]
        errors += [
            SpecError(
                f"spec.embeddings[{i}].dim",
                f"is {t['dim']}, but the built-in"
                f" DLRM needs every table as wide as the first ({dim}): its dot"
                " interaction multiplies them pairwise (or give dense.import)",
            )
            for i, t in enumerate(embeddings)
            if t["dim"] != dim
        ]
    if "criteo" in (spec.get("data") or {}):
        said = "is not a Criteo categorical feature: C1 ... C26"
        errors += [
            SpecError(f"spec.embeddings[{i}].feature", f"{shown(t['feature'])} {said}")
            for i, t in enumerate(embeddings)
            if t["feature"] not in CRITEO_FEATURES
        ]
    return errors + memory_errors(spec)


HYBRID_JOB = Kind(
    name="HybridJob",
    plural="hybridjobs",
    short_name="hj",
    description="Hybrid DDP + RPC training: parameter servers hold embedding tables, "
    "trainer pods form a DDP group for the dense layers, a master drives them. The operator "
    "makes one pod per process and restarts the whole world when any pod fails.",
    spec=HYBRID_SPEC,
    settings=HybridSpec,
    roles=(
        Role("master"),
        Role(
            "ps",
            count="parameter_servers",
            computes=True,
            latency_bound=True,
            inside=("servers_in_trainers", "trainer"),
        ),
        Role("trainer", "trainers", gpus="gpus_per_trainer", computes=True, latency_bound=True),
    ),
    groups=(ProcessGroup("ddp", "trainer", backend=lambda world: world.backend),),
    trainer="pipejob.trainer.hybrid",
    columns=(
        column(
            "AUC",
            "number",
            ".status.training.evalAuc",
            "Held-out AUC at the last evaluation (spec.embeddings: clicks).",
        ),
        column("Trainers", "integer", ".status.trainers", "Trainers the current world runs."),
        column("Servers", "integer", ".spec.parameterServers"),
    ),
    complete=_completed,
    check=_spec_errors,
    describe=tables.spec_placement_lines,
    elastic="trainers",
)
