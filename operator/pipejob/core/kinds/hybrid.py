"""HybridJob: an EmbeddingBag on a parameter server over RPC, DDP dense layers on trainer
pods, driven by a master. Everything pipejob knows of the kind is declared here, once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipejob.core.common import COMMON, COMMON_RULES, CommonSpec, integer
from pipejob.core.elastic import Size, cel_full, full, needs_checkpoint, size_field
from pipejob.core.kind import Group, Kind, Role, Spec
from pipejob.core.schema import Field, Rule
from pipejob.core.workload import ARGS, HYBRID_DATA, HybridData, args_need_import, import_field

# The bags come from files or the user's code, not from datasetSize and bagSize.
_REAL_DATA = "has(self.data) && (has(self.data.file) || has(self.data.__import__))"

HYBRID_SPEC = Field(
    "object",
    "A hybrid job: an EmbeddingBag on a parameter server over RPC, DDP dense layers on trainers.",
    fields={
        "trainers": size_field("Trainer pods; they form the DDP group.", default=2, minimum=1,
                               maximum=256),
        "embedding": Field(
            "object", "The EmbeddingBag held by the parameter server.",
            fields={
                "numEmbeddings": integer("Rows of the table.", default=100, minimum=1),
                "dim": integer("Width of an embedding.", default=16, minimum=1),
                "mode": Field("string", "How a bag is reduced.", default="sum",
                              enum=("sum", "mean", "max")),
            },
        ),
        "dense": Field(
            "object", "The DDP-replicated dense model on every trainer: a Linear layer from"
            " the bags' embeddings to outFeatures classes, or the user's module (import).",
            fields={
                "outFeatures": integer("Output classes.", default=8, minimum=2),
                "import": import_field(
                    "a torch.nn.Module taking a batch of bag embeddings (batch, dim)"
                ),
                "args": ARGS,
            },
            rules=(args_need_import("dense"),),
        ),
        "batchSize": integer("Bags per trainer step (at trainers.max when elastic); a step"
                             " trains on batchSize x trainers.", default=32, minimum=1),
        "bagSize": integer("Synthetic data: most indices in one bag.", default=10, minimum=1),
        "datasetSize": integer("Synthetic data: samples, split disjointly across trainers.",
                            default=10000, minimum=1),
        "data": HYBRID_DATA,
        "gpusPerTrainer": integer(
            "GPUs per trainer pod (nvidia.com/gpu): 0 runs on CPU, 1 on a GPU (a trainer uses"
            " one).", default=0, maximum=1,
        ),
        "backend": Field(
            "string", "DDP backend of the trainers: gloo without GPUs (the default), nccl with.",
            enum=("gloo", "nccl"),
        ),
        **COMMON,
    },
    rules=(
        Rule(
            "!has(self.backend) || self.backend != 'nccl' || self.gpusPerTrainer > 0",
            "backend nccl needs gpusPerTrainer > 0",
            "backend",
            lambda s: s.get("backend") != "nccl" or s["gpusPerTrainer"] > 0,
        ),
        Rule(
            f"({_REAL_DATA}) || self.datasetSize >= {cel_full('trainers')} * self.batchSize",
            "datasetSize must hold at least one batch per trainer (trainers * batchSize)",
            "datasetSize",
            lambda s: _real_data(s) or s["datasetSize"] >= full(s["trainers"]) * s["batchSize"],
        ),
        Rule(
            "!has(self.optimizer.schedule) && !has(self.optimizer.clipGradNorm)",
            "a HybridJob has no optimizer.schedule or optimizer.clipGradNorm yet: its parameter"
            " server steps the table with each trainer's gradients as they arrive, so there is"
            " no one step to schedule or clip; use a constant lr",
            "optimizer",
            lambda s: "schedule" not in s["optimizer"] and "clipGradNorm" not in s["optimizer"],
        ),
        needs_checkpoint("trainers"),
        *COMMON_RULES,
    ),
)  # fmt: skip


def _real_data(spec: dict[str, Any]) -> bool:
    data = spec.get("data") or {}
    return "file" in data or "import" in data


@dataclass(frozen=True, kw_only=True)
class Embedding:
    num_embeddings: int
    dim: int
    mode: str


@dataclass(frozen=True, kw_only=True)
class Dense:
    out_features: int
    import_: str | None = None  # the user's dense module on the bags' embeddings
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class HybridSpec(CommonSpec):
    trainers: Size  # the world runs at a size the plan gives; the batch is max's
    embedding: Embedding
    dense: Dense
    batch_size: int
    bag_size: int
    dataset_size: int
    gpus_per_trainer: int
    backend: str
    data: HybridData = HybridData()


def _complete(spec: Spec) -> Spec:
    """The DDP backend follows the GPUs unless the user chose it."""
    if "backend" not in spec:
        spec["backend"] = "nccl" if spec["gpusPerTrainer"] > 0 else "gloo"
    return spec


HYBRID_JOB = Kind(
    name="HybridJob",
    plural="hybridjobs",
    short_name="hj",
    description="Hybrid DDP + RPC training: a parameter server holds an EmbeddingBag, "
    "trainer pods form a DDP group for the dense layers, a master drives them. The operator "
    "makes one pod per process and restarts the whole world when any pod fails.",
    spec=HYBRID_SPEC,
    settings=HybridSpec,
    roles=(
        Role("master"),
        Role("ps", computes=True, latency_bound=True),
        Role(
            "trainer",
            count=lambda spec: spec["trainers"],
            gpus="gpusPerTrainer",
            computes=True,
            latency_bound=True,
        ),
    ),  # fmt: skip
    groups=(Group("ddp", "trainer", backend=lambda spec: spec["backend"]),),
    trainer="pipejob.trainer.hybrid",
    columns=(
        {
            "name": "Trainers",
            "type": "integer",
            "jsonPath": ".status.trainers",
            "priority": 1,
            "description": "Trainers the current world runs.",
        },
    ),
    complete=_complete,
    elastic="trainers",
)
