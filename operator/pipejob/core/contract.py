"""Everything that crosses a process boundary between pipejob's parts, in one place: the env
the world plan gives each process, the exit codes and termination messages a failing trainer
leaves, and the master's /progress report the operator reads.

Env: standard torch names where they exist (the RPC world); the rest is prefixed PIPEJOB_."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any, TypedDict

MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"

KIND = "PIPEJOB_KIND"
JOB = "PIPEJOB_JOB"
ROLE = "PIPEJOB_ROLE"
ROLE_INDEX = "PIPEJOB_ROLE_INDEX"
REPLICA = "PIPEJOB_REPLICA"
RPC_NAME = "PIPEJOB_RPC_NAME"
WORLD = "PIPEJOB_WORLD"
ROLES = "PIPEJOB_ROLES"
GROUPS = "PIPEJOB_GROUPS"
ADDRESSES = "PIPEJOB_ADDRESSES"
PREFLIGHT_PORT = "PIPEJOB_PREFLIGHT_PORT"
MONITOR_PORT = "PIPEJOB_MONITOR_PORT"
SPEC = "PIPEJOB_SPEC"
GPUS = "PIPEJOB_GPUS"
RENDEZVOUS_TIMEOUT = "PIPEJOB_RENDEZVOUS_TIMEOUT"

DDP_GROUP = "PIPEJOB_DDP_GROUP"
DDP_ADDR = "PIPEJOB_DDP_ADDR"
DDP_PORT = "PIPEJOB_DDP_PORT"
DDP_RANK = "PIPEJOB_DDP_RANK"
DDP_WORLD_SIZE = "PIPEJOB_DDP_WORLD_SIZE"
DDP_BACKEND = "PIPEJOB_DDP_BACKEND"

# Optional, set by whoever runs the world rather than by the plan.
SUMMARY_FILE = "PIPEJOB_SUMMARY_FILE"
TERMINATION_LOG = "PIPEJOB_TERMINATION_LOG"
TUNING = "PIPEJOB_TUNING"
POD_NAME = "PIPEJOB_POD_NAME"
MASTER_FIRST = "PIPEJOB_MASTER_FIRST"

DOCS: dict[str, str] = {
    MASTER_ADDR: "Address of the master: the RPC rendezvous (TCP store) host.",
    MASTER_PORT: "Port of the RPC rendezvous on the master.",
    RANK: "This process's rank in the RPC world (master is 0).",
    WORLD_SIZE: "Processes in the RPC world.",
    KIND: "PipelineJob or HybridJob.",
    JOB: "Name of the job.",
    ROLE: "master, stage, ps or trainer.",
    ROLE_INDEX: "Index of this process within its role (stage i, trainer k).",
    REPLICA: "PipelineJob: the replica of the pipeline this process belongs to (0 if one).",
    RPC_NAME: "This process's RPC worker name (master, stage0, ps0, trainer1, ...).",
    WORLD: "Comma-separated RPC names of the whole world, in rank order.",
    ROLES: "Comma-separated roles of the whole world, in rank order.",
    GROUPS: "The world's collective groups, if any: `name=rank,rank,...` (world ranks in group"
    " rank order), separated by `;`.",
    ADDRESSES: "Comma-separated addresses of the whole world, in rank order (for messages).",
    PREFLIGHT_PORT: "Port of the whole world's gloo group for the preflight check (master).",
    MONITOR_PORT: "Port of the master's HTTP endpoint: /progress (JSON) and /metrics.",
    SPEC: "The job's validated, defaulted spec as JSON.",
    GPUS: "GPUs this process may use; 0 means CPU (and gloo).",
    RENDEZVOUS_TIMEOUT: "Seconds to wait for the RPC world and DDP group to form.",
    DDP_GROUP: "Members of a collective group (HybridJob trainers: ddp; stage i of replicated"
    " PipelineJob stages: dp<i>; every stage of a PipelineJob on engine pipelining: pipe):"
    " the group's name.",
    DDP_ADDR: "Group members: address of the group's rendezvous (its rank 0).",
    DDP_PORT: "Group members: port of the group's rendezvous, never the RPC one.",
    DDP_RANK: "Group members: rank in the group (a trainer's DDP rank, a stage's replica; in"
    " pipe, replica x stages + stage).",
    DDP_WORLD_SIZE: "Group members: size of the group.",
    DDP_BACKEND: "Group members: gloo or nccl.",
    SUMMARY_FILE: "Optional: the master writes its end-of-run summary here as JSON.",
    TERMINATION_LOG: "Optional: where a failing process writes its one-line reason, and the"
    " master that exits 0 its last /progress report as JSON (default /dev/termination-log,"
    " Kubernetes' termination message).",
    POD_NAME: "Optional: the name of this process's pod (the operator sets it; the local"
    " runner does not), for the watchdog's messages.",
    MASTER_FIRST: "Optional: set where the master starts alone and the other members once its"
    " /progress phase leaves `starting`: a PipelineJob's master then checks its model against"
    " the data and the loss before the world forms, and a refusal comes before any other"
    " member starts. 1: the others start as processes right after (`pipejob run`); pods: the"
    " operator creates their pods then (no spec.scheduling), and the master's wait for them"
    " allows rendezvousTimeoutSeconds more for their scheduling and image pulls. Unset (a gang"
    " scheduler starts every pod at once), it checks them once the world formed.",
    TUNING: "Optional: performance levers (threads, allocator, transport): unset or on for"
    " all, off for none, or a comma-separated list; allocator=tcmalloc, jemalloc or glibc"
    " picks the malloc (tcmalloc unless told). Variables the user sets always win.",
}


# --- how a trainer process ends --------------------------------------------------------


class ExitCode(IntEnum):
    SUCCEEDED = 0
    TRAINING_FAILED = 1  # an exception while training
    BAD_ENVIRONMENT = 2  # the env does not hold what the plan promises
    RENDEZVOUS_FAILED = 3  # the RPC world or a group did not form in time
    PREFLIGHT_FAILED = 4  # the world failed its communication check
    # A configuration error a restart would only repeat: the job fails at once, without
    # spending backoffLimit (as PyTorchJob's ExitCode policy and JobSet's reason rules do).
    PERMANENT = 5
    # A member stopped answering (the watchdog, runtime/watchdog.py): retryable, as a
    # restarted world resumes from its checkpoint.
    STALLED = 6


# A failing process writes one line to its termination message (Kubernetes shows it in the
# pod's status); when the preflight check failed, the line starts with this.
PREFLIGHT_PREFIX = "preflight:"
# A process that failed only because the world broke under it (a peer died or left) says
# "world broke: <what it saw>": the cause is another member's failure, which is named instead.
BROKEN_PREFIX = "world broke:"
# A stalled world's line is "stalled: <member> (<pod or pid>) stopped answering: ..." or, for a
# world whose members all answer but whose work stopped, "stalled: no progress for ...".
STALLED_PREFIX = "stalled:"
# A permanent failure's line is "permanent: <Reason>: <what happened>", Reason one of these.
PERMANENT_PREFIX = "permanent:"
PERMANENT_REASONS: dict[str, str] = {
    "BadEnvironment": "the pod's environment breaks the env contract (a trainer image of"
    " another pipejob version, or env overridden by hand)",
    "ImportFailed": "a module the job needs cannot be imported: the image lacks it",
    "ShapeMismatch": "tensors that do not fit together: the model, its input size or its cut"
    " into stages disagree",
    "InvalidConfiguration": "a value of the spec the trainer cannot use (a ValueError or"
    " TypeError from the model, the optimizer or the data)",
    "NonFinite": "the loss, the gradient norm or the model's held-out outputs became NaN or"
    " infinite: the step was not applied and the last checkpoint is kept (a restart would"
    " resume from it only to reach the same step again)",
    "CheckpointUnusable": "the checkpoint under checkpoint.path cannot be resumed by this job"
    " (another kind of job or another model), or written (a path its processes do not share)",
}


def permanent_message(reason: str, message: str) -> str:
    """The termination message of a permanent failure."""
    assert reason in PERMANENT_REASONS, reason
    return f"{PERMANENT_PREFIX} {reason}: {message}"


def parse_permanent(message: str) -> tuple[str, str] | None:
    """(reason, message) of a permanent failure's termination message, else None. When the
    message is the end of the log (no termination message was written), the trainer's last
    line counts: it logs the permanent line last."""
    for line in reversed(message.strip().splitlines()):
        if line.startswith(PERMANENT_PREFIX):
            reason, _, rest = line[len(PERMANENT_PREFIX) :].strip().partition(": ")
            return (reason, rest) if reason in PERMANENT_REASONS else None
    return None


# Longest message the operator copies from a report or a termination message into status.
MAX_MESSAGE = 300


# --- the watchdog's heartbeats -----------------------------------------------------------

# Every member POSTs a small JSON heartbeat ({"member", "pod", "pid"}) to the master's monitor
# port at this path; the reply says the master's phase, step and the watchdog's bound.
HEARTBEAT_PATH = "/heartbeat"
# The bound when spec.watchdog is not set: max(floor, factor x the longest measured step),
# capped (seconds).
WATCHDOG_FLOOR = 60.0
WATCHDOG_FACTOR = 10.0
WATCHDOG_CAP = 600.0


# --- the master's GET /progress --------------------------------------------------------

# What the master is doing, in order.
PHASES = ("starting", "preflight", "training", "finished", "failed")


@dataclass(frozen=True)
class PreflightResult:
    ok: bool
    message: str


# The evaluation's figures in a report (numbers; evalStep is its step).
EVAL_FIGURES = ("evalLoss", "evalAccuracy", "evalPerplexity", "evalAuc")
# A member's peak memory in a report's `memory`, in bytes: the peak resident set (VmHWM) and
# torch.cuda.max_memory_allocated where the member uses a GPU.
MEMORY_FIGURES = ("rssPeakBytes", "cudaPeakBytes")


class PreflightJson(TypedDict):
    """A report's preflight outcome as JSON."""

    ok: bool
    message: str


class ReportedFigures(TypedDict, total=False):
    """A report's figures as the job's status.training shows them (Progress's fields but
    preflight, those the master knows): what the operator reads from /progress and from a
    finished master's termination message."""

    step: int
    steps: int
    phase: str
    loss: float
    samplesPerSecond: float
    bubble: float
    learningRate: float
    gradNorm: float
    resumedFromStep: int
    message: str
    evalStep: int
    evalLoss: float
    evalAccuracy: float
    evalPerplexity: float
    evalAuc: float
    memory: dict[str, dict[str, int]]
    checkpointStep: int
    checkpointTime: str
    engine: str


class ProgressJson(ReportedFigures, total=False):
    """The master's GET /progress body (Progress.to_json): the figures, and the preflight."""

    preflight: PreflightJson | None


@dataclass(frozen=True)
class Progress:
    """The master's report, as JSON with these names (camelCase, as the job's status)."""

    step: int
    steps: int
    phase: str | None = None
    loss: float | None = None
    samplesPerSecond: float | None = None  # the JSON's name
    bubble: float | None = None  # PipelineJob: idle share of stage time
    learningRate: float | None = None  # the last optimizer step's
    gradNorm: float | None = None  # global L2 norm of its gradients, unclipped
    resumedFromStep: int | None = None
    message: str | None = None
    preflight: PreflightResult | None = None
    # The last evaluation on held-out data (spec.eval): its step and figures; accuracy for
    # classification, perplexity for the language model, AUC for clicks.
    evalStep: int | None = None
    evalLoss: float | None = None
    evalAccuracy: float | None = None
    evalPerplexity: float | None = None
    evalAuc: float | None = None
    # Each member's peak memory so far, by RPC name: {"rssPeakBytes": n} and, on a GPU,
    # "cudaPeakBytes" (MEMORY_FIGURES).
    memory: dict[str, dict[str, int]] | None = None
    # The newest complete checkpoint this world wrote: its step, and when (RFC 3339, UTC).
    # An elastic world grows back once one is written after capacity returned.
    checkpointStep: int | None = None
    checkpointTime: str | None = None
    # PipelineJob: the engine the master runs the job on (rpc or pipelining; the one
    # `engine: auto` chose), once it has chosen.
    engine: str | None = None

    def to_json(self) -> ProgressJson:
        """The report as the master serves it (every field, None as null)."""
        return asdict(self)  # type: ignore[return-value]

    def figures(self) -> ReportedFigures:
        """The fields the job's status.training shows (all but preflight), None left out."""
        figures = {k: v for k, v in self.to_json().items() if k != "preflight" and v is not None}
        return figures  # type: ignore[return-value]

    @classmethod
    def parse(cls, data: Any) -> Progress:
        """A report read from JSON, checked: anything but a report raises ValueError; an
        unknown phase or a figure of the wrong type counts as absent."""
        if not isinstance(data, dict):
            raise ValueError(f"a report is a JSON object, got {type(data).__name__}")
        step, steps = data.get("step"), data.get("steps")
        if not _is_count(step) or not _is_count(steps):
            raise ValueError(f"a report has whole numbers step and steps, got {step!r}, {steps!r}")
        figures = {
            k: float(data[k])
            for k in (
                "loss",
                "samplesPerSecond",
                "bubble",
                "learningRate",
                "gradNorm",
                *EVAL_FIGURES,
            )
            if _is_number(data.get(k))
        }
        message = data.get("message")
        preflight = data.get("preflight")
        if isinstance(preflight, dict) and isinstance(preflight.get("ok"), bool):
            text = preflight.get("message")
            text = text[:MAX_MESSAGE] if isinstance(text, str) else ""
            preflight = PreflightResult(preflight["ok"], text)
        else:
            preflight = None
        return cls(
            step=step,
            steps=steps,
            phase=data["phase"] if data.get("phase") in PHASES else None,
            resumedFromStep=data["resumedFromStep"]
            if _is_count(data.get("resumedFromStep"))
            else None,
            evalStep=data["evalStep"] if _is_count(data.get("evalStep")) else None,
            checkpointStep=data["checkpointStep"]
            if _is_count(data.get("checkpointStep"))
            else None,
            checkpointTime=_rfc3339_time(data.get("checkpointTime")),
            message=message[:MAX_MESSAGE] if isinstance(message, str) and message else None,
            preflight=preflight,
            memory=_memory_figures(data.get("memory")),
            engine=_engine(data.get("engine")),
            **figures,
        )


def _memory_figures(data: Any) -> dict[str, dict[str, int]] | None:
    """A report's `memory`, keeping only members named by a string with whole-number
    figures; None if nothing is left."""
    if not isinstance(data, dict):
        return None
    kept = {
        member: {k: v for k, v in figures.items() if k in MEMORY_FIGURES and _is_count(v)}
        for member, figures in data.items()
        if isinstance(member, str) and isinstance(figures, dict)
    }
    return {member: figures for member, figures in kept.items() if figures} or None


def _engine(value: Any) -> str | None:
    """An engine a master runs a PipelineJob on, else None."""
    from pipejob.core.kinds.pipeline_schedules import PIPELINING, RPC  # kinds import this

    return value if value in (PIPELINING, RPC) else None


def _rfc3339_time(value: Any) -> str | None:
    """An RFC 3339 time as the trainer writes it (2026-11-27T10:00:00Z), else None."""
    if isinstance(value, str) and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", value):
        return value
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
