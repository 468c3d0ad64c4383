"""The two job kinds: their spec tables, and parsing + defaulting + validating a manifest.

The manifest is the very YAML a user `kubectl apply`s. Every error names its field path."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipejob.core.schema import Field, Rule, SpecError, apply

GROUP = "pipejob.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KINDS = ("PipelineJob", "HybridJob")

# Models whose torchvision structure the trainer knows how to cut into sequential layers.
PIPELINE_MODELS = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "wide_resnet50_2", "wide_resnet101_2",
    "vgg11", "vgg13", "vgg16", "vgg19", "vgg11_bn", "vgg13_bn", "vgg16_bn", "vgg19_bn",
    "alexnet", "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large",
    "efficientnet_b0", "efficientnet_b1", "convnext_tiny",
)  # fmt: skip

DNS_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
AUTO = "auto"  # PipelineJob.spec.microBatches: the trainer chooses the count
# Pod names are "<job>-<role>-<index>" and must stay valid DNS labels (63 characters).
MAX_JOB_NAME = 40


def _int(description: str, default: int | None = None, minimum: int | None = 0, **kw) -> Field:
    return Field("integer", description, default=default, minimum=minimum, **kw)


OPTIMIZER = Field(
    "object",
    "The optimizer every parameter is stepped with: a PipelineJob's through"
    " DistributedOptimizer; a HybridJob's table by one per trainer on the parameter server,"
    " its dense layer by each trainer's own.",
    fields={
        "name": Field(
            "string", "Optimizer from torch.optim.", default="sgd",
            enum=("sgd", "adam", "adamw", "rmsprop"),
        ),
        "lr": Field("number", "Learning rate.", default=0.05, minimum=0, exclusive_minimum=True),
        "momentum": Field(
            "number", "Momentum (sgd and rmsprop only).", default=0.0, minimum=0, maximum=1
        ),
        "weightDecay": Field("number", "L2 weight decay.", default=0.0, minimum=0),
    },
)  # fmt: skip

_ANY = Field("object", "A Kubernetes object, passed through as written.", free_form=True)
_LIST = Field("array", "A list of Kubernetes objects, passed through as written.", items=_ANY)

TEMPLATE = Field(
    "object",
    "Overrides for every pod of the job: the operator's defaults apply where this is silent.",
    fields={
        "image": Field("string", "Trainer container image."),
        "imagePullPolicy": Field(
            "string", "Image pull policy.", enum=("Always", "IfNotPresent", "Never")
        ),
        "resources": Field(
            "object", "Container resources; GPU counts come from the spec's GPU fields.",
            free_form=True,
        ),
        "nodeSelector": Field(
            "object", "Node labels the pods must match.",
            values=Field("string", "Label value."),
        ),
        "tolerations": _LIST,
        "affinity": _ANY,
        "volumes": _LIST,
        "volumeMounts": _LIST,
        "env": _LIST,
        "serviceAccountName": Field("string", "Service account of the pods."),
        "schedulerName": Field("string", "Scheduler of the pods (e.g. volcano)."),
        "priorityClassName": Field("string", "Priority class of the pods."),
    },
)  # fmt: skip

# Fields every kind has: how long to wait, how to restart, and when to clean up.
COMMON: dict[str, Field] = {
    "steps": _int("Training steps (batches) to run.", default=10, minimum=1),
    "seed": _int("Seed of model initialisation and synthetic data.", default=0),
    "optimizer": OPTIMIZER,
    "logEvery": _int("Print progress every this many steps.", default=1, minimum=1),
    "rendezvousTimeoutSeconds": _int(
        "How long each process waits for the RPC world (and DDP group) to form.",
        default=300, minimum=1,
    ),
    "backoffLimit": _int("Whole-world restarts allowed before the job fails.", default=3),
    "activeDeadlineSeconds": _int(
        "Fail the job (DeadlineExceeded) once it has been running this long.", minimum=1
    ),
    "ttlSecondsAfterFinished": _int("Delete the job this long after it finished."),
    "suspend": Field("boolean", "Remove the job's pods while true.", default=False),
    "template": TEMPLATE,
    "checkpoint": Field(
        "object",
        "Save the world every few steps and resume from the newest complete checkpoint.",
        fields={
            "path": Field("string", "Directory shared by every process of the job."),
            "everySteps": _int("Checkpoint every this many steps.", default=10, minimum=1),
            "volume": Field(
                "string", "Name of a volume in template.volumes; the operator mounts it at"
                " `path` in every pod. Omit it when the template already mounts `path`.",
                pattern=DNS_LABEL,
            ),
        },
        required=("path",),
        section=True,
    ),
    "profile": Field(
        "object",
        "Run the torch profiler around chosen steps; one Chrome trace per process.",
        fields={
            "steps": Field("array", "Steps (1-based) to profile.",
                           items=_int("A step to profile.", minimum=1), default=[2]),
            "path": Field("string", "Directory for the traces (default: <checkpoint.path>/"
                          "profiles)."),
            "rowLimit": _int("Rows of the logged key_averages table.", default=15, minimum=1),
        },
        section=True,
    ),
    "preflight": Field(
        "object",
        "A communication check of the whole world before training.",
        fields={
            "enabled": Field("boolean", "Run the check.", default=True),
            "timeoutSeconds": _int("Deadline for every peer to take part.", default=60,
                                   minimum=1),
            "megabytes": Field("number", "Payload of the bandwidth test per link.", default=4.0,
                               minimum=0, exclusive_minimum=True, maximum=1024),
        },
    ),
}  # fmt: skip

# Cross-field rules every kind shares.
COMMON_RULES = (
    Rule(
        "!has(self.profile) || has(self.profile.path) || has(self.checkpoint)",
        "profile needs profile.path or a checkpoint.path to write its traces under",
        "profile",
        lambda s: "profile" not in s or "path" in s["profile"] or "checkpoint" in s,
    ),
)

PIPELINE_SPEC = Field(
    "object",
    "A pipeline-parallel job: a master drives micro-batches through `stages` RPC workers.",
    fields={
        "model": Field(
            "string", "torchvision classification model to train, cut into stages.",
            default="resnet50", enum=PIPELINE_MODELS,
        ),
        "stages": _int("Pipeline stages, one pod each.", default=2, minimum=2, maximum=64),
        "microBatches": Field(
            "int-or-string",
            "Micro-batches each batch is split into, or `auto`: the master measures the"
            " model's layers at each candidate count (powers of two dividing batchSize, with"
            " micro-batches of at least 2) and runs the one with the shortest predicted step.",
            default=4, minimum=1, pattern=AUTO,
        ),
        "batchSize": _int("Images per batch (per step).", default=32, minimum=1),
        "imageSize": _int(
            "Height and width of the square input images.", default=224, minimum=32, maximum=1024
        ),
        "numClasses": _int("Classes of the classifier head.", default=1000, minimum=2),
        "gpusPerStage": _int(
            "GPUs per stage pod (nvidia.com/gpu); 0 runs on CPU.", default=0, maximum=16
        ),
        **COMMON,
    },
    rules=(
        Rule(
            "type(self.microBatches) == string || self.batchSize % self.microBatches == 0",
            "batchSize must be divisible by microBatches",
            "microBatches",
            lambda s: s["microBatches"] == AUTO or s["batchSize"] % s["microBatches"] == 0,
        ),
        *COMMON_RULES,
    ),
)  # fmt: skip

HYBRID_SPEC = Field(
    "object",
    "A hybrid job: an EmbeddingBag on a parameter server over RPC, DDP dense layers on trainers.",
    fields={
        "trainers": _int("Trainer pods; they form the DDP group.", default=2, minimum=1,
                         maximum=256),
        "embedding": Field(
            "object", "The EmbeddingBag held by the parameter server.",
            fields={
                "numEmbeddings": _int("Rows of the table.", default=100, minimum=1),
                "dim": _int("Width of an embedding.", default=16, minimum=1),
                "mode": Field("string", "How a bag is reduced.", default="sum",
                              enum=("sum", "mean", "max")),
            },
        ),
        "dense": Field(
            "object", "The DDP-replicated dense layer on every trainer.",
            fields={"outFeatures": _int("Output classes.", default=8, minimum=2)},
        ),
        "batchSize": _int("Bags per trainer step.", default=32, minimum=1),
        "bagSize": _int("Most indices in one bag.", default=10, minimum=1),
        "datasetSize": _int("Synthetic samples, split disjointly across trainers.",
                            default=10000, minimum=1),
        "gpusPerTrainer": _int(
            "GPUs per trainer pod (nvidia.com/gpu); 0 runs on CPU.", default=0, maximum=16
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
            "self.datasetSize >= self.trainers * self.batchSize",
            "datasetSize must hold at least one batch per trainer (trainers * batchSize)",
            "datasetSize",
            lambda s: s["datasetSize"] >= s["trainers"] * s["batchSize"],
        ),
        *COMMON_RULES,
    ),
)  # fmt: skip

SPECS = {"PipelineJob": PIPELINE_SPEC, "HybridJob": HYBRID_SPEC}


class InvalidSpec(ValueError):
    """A manifest that cannot run; `errors` names each field path and the reason."""

    def __init__(self, errors: list[SpecError], source: str = "manifest"):
        self.errors = errors
        self.source = source
        lines = "\n".join(f"  {e}" for e in errors)
        super().__init__(f"{source}: invalid job:\n{lines}")


@dataclass(frozen=True)
class Job:
    kind: str
    name: str
    namespace: str | None
    spec: dict[str, Any]  # defaulted and validated, camelCase as in the manifest
    uid: str | None = None

    @property
    def spec_json(self) -> str:
        return json.dumps(self.spec, sort_keys=True, separators=(",", ":"))


def parse(manifest: Any, source: str = "manifest") -> Job:
    """Validate and default one job manifest (a dict as loaded from YAML)."""
    errors: list[SpecError] = []
    if not isinstance(manifest, dict):
        raise InvalidSpec([SpecError("(document)", "must be a mapping")], source)
    if manifest.get("apiVersion") != API_VERSION:
        errors.append(SpecError(
            "apiVersion", f"must be {API_VERSION}, got {manifest.get('apiVersion')!r}"
        ))  # fmt: skip
    kind = manifest.get("kind")
    if kind not in SPECS:
        errors.append(SpecError("kind", f"must be one of {', '.join(KINDS)}, got {kind!r}"))
    for key in manifest:
        if key not in ("apiVersion", "kind", "metadata", "spec", "status"):
            errors.append(SpecError(key, "unknown top-level field"))
    meta = manifest.get("metadata")
    name = namespace = uid = None
    if not isinstance(meta, dict):
        errors.append(SpecError("metadata", "is required and must be a mapping"))
    else:
        name, namespace, uid = meta.get("name"), meta.get("namespace"), meta.get("uid")
        if not isinstance(name, str) or not name:
            errors.append(SpecError("metadata.name", "is required"))
        elif not re.fullmatch(DNS_LABEL, name):
            errors.append(SpecError(
                "metadata.name",
                f"must be a DNS label (lowercase letters, digits, '-', starting with a letter),"
                f" got {name!r}",
            ))  # fmt: skip
        elif len(name) > MAX_JOB_NAME:
            errors.append(SpecError(
                "metadata.name",
                f"must be at most {MAX_JOB_NAME} characters so pod names stay DNS labels",
            ))  # fmt: skip
    spec_in = manifest.get("spec", {})
    spec: dict[str, Any] = {}
    if spec_in is None:
        spec_in = {}
    if kind in SPECS:
        spec = apply(SPECS[kind], spec_in, "spec", errors)
    if errors:
        raise InvalidSpec(errors, source)
    if kind == "HybridJob" and "backend" not in spec:
        spec["backend"] = "nccl" if spec["gpusPerTrainer"] > 0 else "gloo"
    return Job(kind=kind, name=name, namespace=namespace, spec=spec, uid=uid)


def load(path: str | Path) -> Job:
    """Read one job manifest file; errors name the file (and the YAML line if it is bad YAML)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise InvalidSpec([SpecError("(file)", e.strerror or str(e))], str(path)) from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(document)"
        reason = getattr(e, "problem", None) or str(e)
        raise InvalidSpec([SpecError(where, f"not valid YAML: {reason}")], str(path)) from None
    if len(docs) != 1:
        raise InvalidSpec(
            [SpecError("(document)", f"must hold exactly one job, found {len(docs)} documents")],
            str(path),
        )
    return parse(docs[0], str(path))
