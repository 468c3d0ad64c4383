"""What every kind's spec has (steps, seed, optimizer, loss, evaluation, output, restarts, pod
template, checkpoint, profile, preflight): its table, and the typed objects the trainer reads.
`from_spec` fills those dataclasses from a defaulted spec (field `weight_decay` reads key
`weightDecay`); tests/test_kinds.py checks each against its table."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

from pipejob.core import oom, scheduling
from pipejob.core.elastic import Size
from pipejob.core.kind import RawSpec, spec_key
from pipejob.core.oom import OOM, OomPolicy
from pipejob.core.optimizer import OPTIMIZER, Optimizer
from pipejob.core.pod_template import TEMPLATE
from pipejob.core.scheduling import MANAGED_BY, SCHEDULING, TOPOLOGY, Scheduling
from pipejob.core.scheduling import RULES as SCHEDULING_RULES
from pipejob.core.schema import Field, Rule, integer, integer_list
from pipejob.core.workload import EVAL, LOSS, OUTPUT, Eval, Loss, Output

DNS_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
# Bounds that keep times representable: Python's datetime and torch's timeouts overflow
# long before int64 does.
DAY = 24 * 3600
WEEK = 7 * DAY
INT32_MAX = 2**31 - 1  # 68 years
PENDING_SECONDS = 120  # spec.elastic.pendingSeconds when the section is left out

# Fields every kind has: how long to wait, how to restart, and when to clean up.
COMMON: dict[str, Field] = {
    "steps": integer("Training steps (batches) to run.", default=10, minimum=1),
    "seed": integer(
        "Seed of everything random in a run: model initialisation, data order and synthetic"
        " data, dropout masks and the measured cut's choices. Two runs of one manifest write"
        " the same bits on CPUs.",
        default=0,
    ),
    "deterministic": Field(
        "boolean",
        "Ask torch for deterministic kernels (torch.use_deterministic_algorithms) where"
        " exactness costs speed, as on a GPU (scatter-adds, some convolutions' backwards and"
        " cuBLAS, which then keeps a workspace per stream); a kernel with no deterministic"
        " version stops the run with torch's error. CPUs repeat themselves without it."
        " It pins the cut too: without splitPoints, each layer's cost is counted (forward +"
        " backward FLOPs and bytes moved on a sample), not timed, so every run cuts alike;"
        " and microBatches auto chooses its count by that count too (the slowest stage's"
        " count per micro-batch plus a fixed overhead, times the schedule's slots), not by"
        " timing, so every run chooses alike.",
        default=False,
    ),
    "optimizer": OPTIMIZER,
    "loss": LOSS,
    "eval": EVAL,
    "output": OUTPUT,
    "logEvery": integer("Print progress every this many steps.", default=1, minimum=1),
    "logging": Field(
        "object",
        "Where the master writes its figures besides the log.",
        fields={
            "tensorboard": Field(
                "string",
                "Directory of TensorBoard event files: the loss, learning rate,"
                " gradient norm, samples/s, bubble and evaluation figures per step (mount a"
                " volume there on a cluster; `tensorboard --logdir` reads it).",
                pattern=r".*\S.*",
                pattern_says="name a directory",
                max_length=4096,
            ),
        },
        section=True,
    ),
    "rendezvousTimeoutSeconds": integer(
        "How long each process waits for the RPC world (and DDP group) to form.",
        default=300,
        minimum=1,
        maximum=WEEK,
    ),
    "backoffLimit": integer("Whole-world restarts allowed before the job fails.", default=3),
    "activeDeadlineSeconds": integer(
        "Fail the job (DeadlineExceeded) once it has been running this long.",
        minimum=1,
        maximum=INT32_MAX,
    ),
    "ttlSecondsAfterFinished": integer(
        "Delete the job this long after it finished.", maximum=INT32_MAX
    ),
    "suspend": Field("boolean", "Remove the job's pods while true.", default=False),
    "template": TEMPLATE,
    "checkpoint": Field(
        "object",
        "Save the world every few steps and resume from the newest complete checkpoint.",
        fields={
            "path": Field(
                "string",
                "Directory shared by every process of the job. On a cluster, a"
                " world of several pods needs it on a shared volume: `volume`, or a"
                " template volume mounted at or above it.",
                pattern=r".*\S.*",
                pattern_says="name a directory",
            ),
            "everySteps": integer("Checkpoint every this many steps.", default=10, minimum=1),
            "volume": Field(
                "string",
                "Name of a volume in template.volumes; the operator mounts it at"
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
            "steps": integer_list(
                "Steps (1-based) to profile.", "A step to profile.", default=[2], max_items=64
            ),
            "path": Field(
                "string",
                "Directory for the traces (default: <checkpoint.path>/profiles).",
                pattern=r".*\S.*",
                pattern_says="name a directory",
                max_length=4096,
            ),
            "rowLimit": integer("Rows of the logged key_averages table.", default=15, minimum=1),
        },
        section=True,
    ),
    "preflight": Field(
        "object",
        "A communication check of the whole world before training.",
        fields={
            "enabled": Field("boolean", "Run the check.", default=True),
            "timeoutSeconds": integer(
                "Deadline for every peer to take part.", default=60, minimum=1, maximum=DAY
            ),
            "megabytes": Field(
                "number",
                "Payload of the bandwidth test per link.",
                default=4.0,
                minimum=0,
                exclusive_minimum=True,
                maximum=1024,
            ),
        },
    ),
    "watchdog": Field(
        "object",
        "How long a member may stop answering (heartbeats, independent of torch RPC) before"
        " the job fails retryably, naming it. Without this section: max(60 s, 10x the"
        " longest measured step), at most 600 s.",
        fields={
            "seconds": integer(
                "Seconds without a heartbeat that make a member stalled.", minimum=2, maximum=DAY
            ),
        },
        required=("seconds",),
        section=True,
    ),
    "scheduling": SCHEDULING,
    "elastic": Field(
        "object",
        "How an elastic world ({min, max} of replicas or trainers) follows the cluster's capacity.",
        fields={
            "pendingSeconds": integer(
                "How long pods of the world may stay unschedulable before the world restarts"
                " at the largest size that fits.",
                default=PENDING_SECONDS,
                minimum=1,
                maximum=DAY,
            ),
        },
        section=True,
    ),
    "oom": OOM,
    "topology": TOPOLOGY,
    "managedBy": MANAGED_BY,
}

# Cross-field rules every kind shares.
COMMON_RULES = (
    Rule(
        "!has(self.optimizer.schedule) || self.optimizer.schedule.warmupSteps <= self.steps",
        "optimizer.schedule.warmupSteps must be at most spec.steps (warmup is part of the run)",
        "optimizer.schedule.warmupSteps",
        lambda s: (
            "schedule" not in s["optimizer"]
            or s["optimizer"]["schedule"]["warmupSteps"] <= s["steps"]
        ),
    ),
    Rule(
        "!has(self.profile) || self.profile.steps.all(s, s <= self.steps)",
        "every profiled step must be one of the job's steps (at most spec.steps)",
        "profile.steps",
        lambda s: "profile" not in s or all(p <= s["steps"] for p in s["profile"]["steps"]),
    ),
    Rule(
        "!has(self.profile) || has(self.profile.path) || has(self.checkpoint)",
        "profile needs profile.path or a checkpoint.path to write its traces under",
        "profile",
        lambda s: "profile" not in s or "path" in s["profile"] or "checkpoint" in s,
    ),
    *SCHEDULING_RULES,
)

# Spec fields only the operator reads (they shape pods or steer the job, not training).
OPERATOR_ONLY = (
    "template",
    "backoffLimit",
    "activeDeadlineSeconds",
    "ttlSecondsAfterFinished",
    "suspend",
    "checkpoint.volume",
    "scheduling",
    "elastic",
    "oom",
    "topology",
    "managedBy",
)


@dataclass(frozen=True, kw_only=True)
class CommonSpec:
    """The fields of COMMON the trainer reads, in the table's order."""

    steps: int
    seed: int
    deterministic: bool = False
    optimizer: Optimizer
    loss: Loss = Loss()
    eval: Eval | None = None
    output: Output | None = None
    log_every: int
    logging: Logging | None = None
    rendezvous_timeout_seconds: int
    checkpoint: Checkpointing | None = None
    profile: Profile | None = None
    preflight: Preflight
    watchdog: Watchdog | None = None


@dataclass(frozen=True, kw_only=True)
class Logging:
    tensorboard: str | None = None


@dataclass(frozen=True, kw_only=True)
class Checkpointing:
    path: str
    every_steps: int


@dataclass(frozen=True, kw_only=True)
class Profile:
    steps: tuple[int, ...]
    row_limit: int
    path: str | None = None


@dataclass(frozen=True, kw_only=True)
class Watchdog:
    seconds: int


@dataclass(frozen=True, kw_only=True)
class Preflight:
    enabled: bool
    timeout_seconds: int
    megabytes: float


@dataclass(frozen=True, kw_only=True)
class RunControl:
    """The fields of OPERATOR_ONLY that steer a job past the parser, as the operator reads
    them (Job.control); the template and checkpoint.volume go into pods as written."""

    suspend: bool
    backoff_limit: int
    active_deadline_seconds: int | None
    pending_seconds: int  # spec.elastic.pendingSeconds
    scheduling: Scheduling | None  # with spec.topology; None: the default scheduler
    oom: OomPolicy


def run_control(spec: RawSpec) -> RunControl:
    """A defaulted spec's RunControl."""
    return RunControl(
        suspend=spec["suspend"],
        backoff_limit=spec["backoffLimit"],
        active_deadline_seconds=spec.get("activeDeadlineSeconds"),
        pending_seconds=(spec.get("elastic") or {}).get("pendingSeconds", PENDING_SECONDS),
        scheduling=scheduling.section(spec.get("scheduling"), spec.get("topology") or {}),
        oom=oom.policy(spec.get("oom") or {}, spec.get("template") or {}),
    )


T = TypeVar("T")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """`cls`'s resolved field types, resolved once: typing.get_type_hints costs more than
    filling the dataclass, and a reconcile fills some for every job it judges."""
    return typing.get_type_hints(cls)


def from_spec(cls: type[T], data: RawSpec) -> T:
    """`cls` (a dataclass above or a kind's) filled from a defaulted spec section."""
    hints = _hints(cls)
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if spec_key(f.name) in data:
            values[f.name] = _typed_value(hints[f.name], data[spec_key(f.name)])
    return cls(**values)


def _typed_value(hint: Any, value: Any) -> Any:
    if isinstance(hint, types.UnionType) and type(None) in hint.__args__:
        others = [a for a in hint.__args__ if a is not type(None)]
        hint = others[0] if len(others) == 1 else hint
    if hint is Size:  # an int-or-object size: n is {min: n, max: n}
        return Size.parse(value)
    if dataclasses.is_dataclass(hint):
        return from_spec(hint, value)
    if typing.get_origin(hint) is tuple:
        (item, _) = typing.get_args(hint)
        return tuple(_typed_value(item, v) for v in value)
    if hint is float:
        return float(value)
    return value
