"""A PipelineJob's engines and schedules (spec.engine, spec.schedule), which micro-batch
counts a schedule can run (spec.microBatches, and the counts `auto` measures), and what
`pipejob plan` says of the path and engine a job takes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipejob.core.errors import SpecError
from pipejob.core.kind import RawSpec
from pipejob.core.schema import Rule
from pipejob.core.workload import CUT_EAGER

if TYPE_CHECKING:  # pipeline.py declares the kind from this module's rules
    from pipejob.core.kinds.pipeline import PipelineSpec

AUTO = "auto"  # spec.microBatches: the master chooses the count

# spec.engine: what moves the micro-batches between the stages (auto: the master chooses).
RPC, PIPELINING = "rpc", "pipelining"
ENGINES = (AUTO, RPC, PIPELINING)
# spec.schedule: the order of a stage's forwards and backwards. The rpc engine runs GPipe.
GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE = "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE)
INTERLEAVING = (INTERLEAVED, ZERO_BUBBLE)  # several stages per process
DEFAULT_SCHEDULE = {RPC: GPIPE, PIPELINING: ONE_F_ONE_B}


def micro_batch_counts(batch: int) -> list[int]:
    """The micro-batch counts `microBatches: auto` considers: 1 and the powers of two that
    divide the batch and leave micro-batches of at least 2 samples (training BatchNorm needs
    two). Doubling spans the range in log2(batch) measurements, whose work adds up to less
    than two batches; finer steps move the predicted step less than its measurement noise."""
    counts = [1]
    while batch % (2 * counts[-1]) == 0 and batch // (2 * counts[-1]) >= 2:
        counts.append(2 * counts[-1])
    return counts


def schedule_refuses(schedule: str, stages: int, micro_batches: int) -> str | None:
    """Why `schedule` cannot run `micro_batches` micro-batches through `stages` stage
    processes, or None when it can: 1F1B keeps `stages` micro-batches in flight, so it needs
    at least that many (torch's Schedule1F1B); the interleaved schedules run the micro-batches
    in rounds of `stages` (torch's rule, in the form every pinned torch version accepts)."""
    if schedule == ONE_F_ONE_B and micro_batches < stages:
        return (
            f"1f1b needs at least as many micro-batches as stages ({stages}), got {micro_batches}"
        )
    if schedule in INTERLEAVING and micro_batches % stages:
        return (
            f"{schedule} runs micro-batches in rounds of one per stage: microBatches must"
            f" be a multiple of stages ({stages}), got {micro_batches}"
        )
    return None


def auto_counts(batch: int, schedule: str, stages: int) -> list[int]:
    """The micro-batch counts `microBatches: auto` measures: those of `micro_batch_counts`
    the schedule can run."""
    return [m for m in micro_batch_counts(batch) if schedule_refuses(schedule, stages, m) is None]


def effective_schedule(spec: RawSpec) -> str:
    """The schedule a defaulted spec runs: its own, or its engine's default."""
    return spec.get("schedule") or default_schedule(spec)


def default_schedule(spec: RawSpec) -> str:
    """The schedule of a spec that names none: gpipe on rpc, 1f1b on pipelining; with
    `engine: auto`, 1f1b where the micro-batch count lets it run (auto, or at least as many
    as stages), else gpipe (which both engines run)."""
    if spec["engine"] != AUTO:
        return DEFAULT_SCHEDULE[spec["engine"]]
    count = spec.get("microBatches", AUTO)
    return ONE_F_ONE_B if count == AUTO or count >= spec["stages"] else GPIPE


# `default_schedule` and `effective_schedule` in CEL, for the rules the API server checks.
DEFAULT_SCHEDULE_CEL = (
    "(self.engine == 'rpc' ? 'gpipe' : (self.engine == 'pipelining' ? '1f1b' :"
    " (type(self.microBatches) == string || self.microBatches >= self.stages ? '1f1b' :"
    " 'gpipe')))"
)
SCHEDULE_CEL = f"(has(self.schedule) ? self.schedule : {DEFAULT_SCHEDULE_CEL})"


# torch.nn's losses whose default reduction is a mean over the samples (the elementwise ones,
# and cross-entropy without class weights, as pipejob's own): the pipelining engine weighs
# each micro-batch's loss 1/microBatches, which equals the batch's loss only for such a mean.
SAMPLE_MEANS = tuple(
    f"torch.nn:{name}"
    for name in (
        "CrossEntropyLoss",
        "MSELoss",
        "L1Loss",
        "SmoothL1Loss",
        "HuberLoss",
        "BCEWithLogitsLoss",
    )
)


def loss_needs_rpc(name: str | None, args: dict[str, Any]) -> str | None:
    """Why `engine: auto` runs the loss `name` (spec.loss.import; None: pipejob's own
    cross-entropy) with `args` on the rpc engine, which computes the whole batch's loss at
    once; None where the pipelining engine's per-micro-batch losses add up to it."""
    if name is None:
        return None
    if name in SAMPLE_MEANS and args.get("reduction", "mean") == "mean" and "weight" not in args:
        return None
    return (
        f"spec.loss {name} is not known to be a mean over the batch's samples, which the"
        " pipelining engine's per-micro-batch losses need (name spec.engine pipelining"
        " where it is one)"
    )


def on_rpc_where_gpus_are_shared(spec: RawSpec) -> tuple[RawSpec, str] | None:
    """`engine: auto` where the stages would share GPUs: the rpc engine (NCCL refuses two
    ranks of the pipelining engine's group on one GPU; rpc stages share it)."""
    if spec["engine"] != AUTO or effective_schedule(spec) in INTERLEAVING:
        return None
    why = "engine auto runs on rpc: its stages share GPUs here, which the pipelining engine cannot"
    return {**spec, "engine": RPC, "schedule": GPIPE}, why


def engine_line(settings: PipelineSpec) -> str:
    """What `pipejob plan` says of the engine: the spec's, or what auto will choose between."""
    schedule = settings.schedule  # the spec's, or its engine's (completed)
    if settings.engine != AUTO:
        return f"engine {settings.engine}, schedule {schedule}"
    why = loss_needs_rpc(settings.loss.import_, settings.loss.args)
    if settings.model.cut == CUT_EAGER:
        why = "the eager path (spec.model.cut: eager) runs on rpc"
    if why is not None and schedule not in INTERLEAVING:
        return f"engine auto: rpc (gpipe): {why}"
    fallback = "rpc (gpipe)" if schedule in (GPIPE, ONE_F_ONE_B) else "no other (refused)"
    return (
        f"engine auto: pipelining (schedule {schedule}) where the stages pass each other only"
        f" tensors, else {fallback}; the master chooses when it cuts the model"
    )


def path_lines(settings: PipelineSpec) -> list[str]:
    """What `pipejob plan` can say of the path before the model is built: only where the
    spec asks for one (auto's choice is made when the job starts; its summary says it)."""
    if settings.model.cut == CUT_EAGER:
        how = "counted cost (spec.deterministic)" if settings.deterministic else "measured cost"
        return [
            "path: eager (spec.model.cut: eager): the master runs the model's own forward and"
            f" the stages its costly modules, placed by {how} when the job starts"
        ]
    lines = []
    if settings.deterministic and not settings.split_points:
        lines.append(
            "cut: counted (spec.deterministic): each layer's forward + backward FLOPs and bytes"
            " moved on a sample, not timed, so every run cuts the model alike"
        )
    if settings.deterministic and settings.micro_batches == AUTO:
        lines.append(
            "microBatches auto: chosen by counted cost (spec.deterministic): the slowest"
            " stage's count per micro-batch plus a fixed one, times the schedule's slots, so"
            " every run chooses alike"
        )
    return lines


def micro_batch_errors(spec: RawSpec) -> list[SpecError]:
    """`microBatches: auto` where it cannot choose: no count the schedule can run."""
    if spec["microBatches"] != AUTO:
        return []
    if auto_counts(spec["batchSize"], spec["schedule"], spec["stages"]):
        return []
    counts = micro_batch_counts(spec["batchSize"])
    return [
        SpecError(
            "spec.microBatches",
            f"auto chooses among {', '.join(map(str, counts))} micro-batches (powers of two"
            f" dividing batchSize {spec['batchSize']}), none of which spec.schedule can run:"
            f" {schedule_refuses(spec['schedule'], spec['stages'], counts[-1])}",
        )
    ]


# spec.model.cut: eager (a model the trace cannot read): what that path does not run yet
EAGER_SPLIT_POINTS = (
    "places the forward's modules itself and takes no split points (they name where the"
    " traced cut's stages begin; with spec.deterministic it places by counted cost, alike in"
    " every run): leave spec.splitPoints out"
)


def eager_rules() -> list[Rule]:
    """The fields a job on the eager path (model.cut: eager) is refused at validation,
    before any process starts (a job that takes the path by itself is refused when its
    master starts, with the same words: pipeline/eager/run.py)."""
    return [
        _eager_refuses(
            "model.cut",
            "self.engine != 'pipelining'",
            lambda s: s["engine"] != PIPELINING,
            "runs on the rpc engine only: set spec.engine: rpc or auto, or leave model.cut out",
        ),
        _eager_refuses(
            "profile",
            "!has(self.profile)",
            lambda s: s.get("profile") is None,
            "does not profile yet: leave spec.profile out",
        ),
        _eager_refuses(
            "splitPoints",
            "!has(self.splitPoints) || size(self.splitPoints) == 0",
            lambda s: not s.get("splitPoints"),
            EAGER_SPLIT_POINTS,
        ),
    ]


def _eager_refuses(field: str, cel: str, holds: Callable[[RawSpec], bool], why: str) -> Rule:
    """A rule: with model.cut eager, `cel` (and `holds`, its Python twin) must hold."""
    return Rule(
        f"type(self.model) == string || !has(self.model.cut) || self.model.cut != 'eager' || {cel}",
        f"the eager path (model.cut: eager) {why}",
        field,
        lambda s: not isinstance(s["model"], dict) or s["model"].get("cut") != "eager" or holds(s),
    )
