"""PipelineJob: a master drives micro-batches through a chain of stage pods (pipeline
parallelism, on either engine: torch.distributed.rpc or torch.distributed.pipelining).
Everything pipejob knows of the kind is declared here, once."""

from __future__ import annotations

from dataclasses import dataclass

from pipejob.core.averaged import EMA, Ema
from pipejob.core.common_spec import COMMON, COMMON_RULES, CommonSpec
from pipejob.core.data_sources import PIPELINE_DATA, PipelineData
from pipejob.core.elastic import Size, elastic_acts, needs_checkpoint, size_field
from pipejob.core.errors import SpecError
from pipejob.core.kind import Kind, ProcessGroup, RawSpec, Role, column
from pipejob.core.kinds import model_facts
from pipejob.core.kinds.pipeline_schedules import (
    AUTO,
    DEFAULT_SCHEDULE_CEL,
    ENGINES,
    GPIPE,
    INTERLEAVING,
    PIPELINING,
    RPC,
    SCHEDULE_CEL,
    SCHEDULES,
    eager_rules,
    effective_schedule,
    engine_line,
    micro_batch_errors,
    on_rpc_where_gpus_are_shared,
    path_lines,
    schedule_refuses,
)
from pipejob.core.kinds.pipeline_schedules import auto_counts as auto_counts  # re-exported
from pipejob.core.kinds.pipeline_schedules import micro_batch_counts as micro_batch_counts
from pipejob.core.schema import Field, Rule, integer
from pipejob.core.workload import Model, model_field

# The torchvision models the trainer knows how to cut: those whose cut model_facts.py records.
PIPELINE_MODELS = tuple(model_facts.LAYERS)

PIPELINE_SPEC = Field(
    "object",
    "A pipeline-parallel job: a master drives micro-batches through `stages` RPC workers.",
    fields={
        "model": model_field(PIPELINE_MODELS, default="resnet50"),
        "stages": integer("Pipeline stages, one pod each.", default=2, minimum=2, maximum=64),
        "splitPoints": Field(
            "array",
            "Where the model is cut: the module names (as in named_modules(), at any depth,"
            " e.g. layer3.1 or transformer.h.6) where stage 1, 2, ... begin; stages x"
            " stagesPerProcess - 1 of them, each once, in the model's order. Without them the"
            " cut is chosen automatically, balanced by measured cost.",
            items=Field("string", "A module name where a stage begins.", max_length=253),
            max_items=63,
        ),
        "data": PIPELINE_DATA,
        "engine": Field(
            "string",
            "What runs the pipeline. auto (the default): the master chooses when it cuts"
            " the model: pipelining where the stages pass each other only tensors and the"
            " loss is a mean over the batch's samples, rpc otherwise (a cut through other"
            " values such as ints or tuples, dict inputs, labels at the cross-entropy's"
            " ignore_index, the user's own loss, the eager path, stages sharing a GPU) where"
            " the schedule is gpipe or 1f1b (rpc runs gpipe); the log"
            " and the summary say which and why. rpc: each stage passes every micro-batch"
            " on to the next over torch.distributed.rpc, a round one call from the master,"
            " with distributed autograd (GPipe's schedule). pipelining: each stage process"
            " holds torch.distributed.pipelining PipelineStages, which pass activations and"
            " gradients to their neighbours over a process group and step `schedule`; the"
            " master still plans, steps and checkpoints them over RPC.",
            default=AUTO,
            enum=ENGINES,
        ),
        "schedule": Field(
            "string",
            "The order of each stage's forwards and backwards (engine pipelining;"
            " the rpc engine runs gpipe). gpipe: every forward, then every backward (each"
            " stage keeps all micro-batches' activations). 1f1b: after a warm-up, one"
            " forward, one backward (at most `stages` micro-batches' activations; needs"
            " microBatches >= stages). interleaved-1f1b and zero-bubble (torch's"
            " ScheduleInterleavedZeroBubble: backwards split into input and weight"
            " gradients to fill the bubble): several stages per process"
            " (`stagesPerProcess`), microBatches a multiple of stages. Default: gpipe on"
            " rpc, 1f1b on pipelining; on auto 1f1b where microBatches is auto or at least"
            " stages, else gpipe.",
            enum=SCHEDULES,
        ),
        "stagesPerProcess": integer(
            "Stages each stage process holds, for the interleaved schedules (at least 2):"
            " the model is cut into stages x stagesPerProcess pieces and process k holds"
            " pieces k, k + stages, ..., which shrinks the bubble by that factor.",
            default=1,
            minimum=1,
            maximum=8,
        ),
        "replicas": size_field(
            "Copies of the pipeline, each on its own share of every batch (data parallel):"
            " stage i of every replica averages its gradients with the others' before each"
            " optimizer step, so the replicas stay identical.",
            default=1,
            minimum=1,
            maximum=64,
        ),
        "microBatches": Field(
            "int-or-string",
            "Micro-batches each batch is split into, or `auto`: the stages measure the"
            " model's layers at each candidate count (powers of two dividing batchSize, with"
            " micro-batches of at least 2) and runs the one with the shortest predicted step"
            " (timed; with spec.deterministic, counted).",
            default=4,
            minimum=1,
            pattern=AUTO,
        ),
        "batchSize": integer(
            "Samples per batch of each replica (at replicas.max when elastic);"
            " a step trains on batchSize x replicas.",
            default=32,
            minimum=1,
        ),
        "imageSize": integer(
            "Height and width of the square input images.", default=224, minimum=32, maximum=1024
        ),
        "numClasses": integer("Classes of the classifier head.", default=1000, minimum=2),
        "gpusPerStage": integer(
            "GPUs per stage pod (nvidia.com/gpu): 0 runs on CPU, 1 on a GPU (a stage uses one).",
            default=0,
            maximum=1,
        ),
        "gradientAccumulation": integer(
            "Batches per optimizer step: their gradients add up (each batch's loss weighted"
            " 1/gradientAccumulation), so a step equals one on a gradientAccumulation times"
            " bigger batch, with the memory of one batch.",
            default=1,
            minimum=1,
            maximum=1024,
        ),
        "precision": Field(
            "string",
            "What the stages compute in: fp32; bf16 (autocast, on CPU and GPU); or"
            " fp16 (autocast with loss scaling, GPU only). Weights and optimizer state stay"
            " float32.",
            default="fp32",
            enum=("fp32", "bf16", "fp16"),
        ),
        "skipNonFiniteSteps": integer(
            "Steps whose loss or gradient norm is not finite (NaN or infinite) that may be"
            " skipped, their update not applied, before the job fails. 0, the default: the"
            " first one fails the job permanently (reason NonFinite), naming the step, the"
            " stage where the first non-finite value came from and the value, with its last"
            " checkpoint kept and no output written. With fp16, a step whose gradients"
            " overflow is skipped by the loss scaling and is not counted.",
            default=0,
            minimum=0,
        ),
        "activationCheckpointing": Field(
            "boolean",
            "Each stage keeps only its inputs in the forward and recomputes its"
            " activations in the backward: less memory for about one more forward.",
            default=False,
        ),
        "ema": EMA,
        **COMMON,
    },
    rules=(
        Rule(
            "type(self.microBatches) == string || self.batchSize % self.microBatches == 0",
            "batchSize must be divisible by microBatches",
            "microBatches",
            lambda s: s["microBatches"] == AUTO or s["batchSize"] % s["microBatches"] == 0,
        ),
        Rule(
            "!has(self.splitPoints) || size(self.splitPoints) == self.stages *"
            " self.stagesPerProcess - 1",
            "must list stages x stagesPerProcess - 1 module names, where stage 1, 2, ... begin",
            "splitPoints",
            lambda s: (
                "splitPoints" not in s
                or len(s["splitPoints"]) == s["stages"] * s["stagesPerProcess"] - 1
            ),
            message_expression="'must list ' + (self.stagesPerProcess == 1 ? 'stages - 1' :"
            " 'stages x stagesPerProcess - 1') + ' = ' + string(self.stages *"
            " self.stagesPerProcess - 1) + ' module names, where stage 1, 2, ... begin; got ' +"
            " string(size(self.splitPoints))",
            explain=lambda s: (
                "must list "
                + ("stages - 1" if s["stagesPerProcess"] == 1 else "stages x stagesPerProcess - 1")
                + f" = {s['stages'] * s['stagesPerProcess'] - 1} module names, where stage 1, 2,"
                f" ... begin; got {len(s['splitPoints'])}"
            ),
        ),
        Rule(
            "!has(self.splitPoints) || self.splitPoints.all(p,"
            " self.splitPoints.filter(q, q == p).size() == 1)",
            "each module name may begin only one stage: list it once",
            "splitPoints",
            lambda s: len(set(s.get("splitPoints", []))) == len(s.get("splitPoints", [])),
        ),
        Rule(
            "self.precision != 'fp16' || self.gpusPerStage > 0",
            "fp16 needs GPUs (gpusPerStage: 1): its loss scaling and half-precision kernels are"
            " GPU features, and this is a CPU job (no GPUs requested); use bf16 on CPU",
            "precision",
            lambda s: s["precision"] != "fp16" or s["gpusPerStage"] > 0,
        ),
        needs_checkpoint("replicas"),
        elastic_acts("replicas"),
        *eager_rules(),
        Rule(
            "self.engine != 'rpc' || !has(self.schedule) || self.schedule == 'gpipe'",
            "the rpc engine (spec.engine) runs gpipe only; set spec.engine: pipelining for"
            " another schedule",
            "schedule",
            lambda s: s["engine"] != RPC or s.get("schedule", GPIPE) == GPIPE,
            message_expression="'the rpc engine (spec.engine) runs gpipe only; set"
            " spec.engine: pipelining for ' + self.schedule",
            explain=lambda s: (
                "the rpc engine (spec.engine) runs gpipe only; set spec.engine:"
                f" pipelining for {s['schedule']}"
            ),
        ),
        Rule(
            "has(self.schedule) && self.schedule in ['interleaved-1f1b', 'zero-bubble'] ?"
            " self.stagesPerProcess >= 2 : self.stagesPerProcess == 1",
            "only the interleaved schedules (spec.schedule interleaved-1f1b or zero-bubble)"
            " hold several stages per process, and they hold at least 2",
            "stagesPerProcess",
            lambda s: (s["stagesPerProcess"] >= 2) == (s.get("schedule") in INTERLEAVING),
            message_expression="has(self.schedule) && self.schedule in ['interleaved-1f1b',"
            " 'zero-bubble'] ? 'spec.schedule ' + self.schedule + ' interleaves several stages"
            " per process: set stagesPerProcess to 2 or more' : 'only the interleaved"
            " schedules (spec.schedule interleaved-1f1b or zero-bubble) hold several stages"
            " per process; spec.schedule is ' + (has(self.schedule) ? self.schedule :"
            f" {DEFAULT_SCHEDULE_CEL} + ', the default of spec.engine ' + self.engine)",
            explain=lambda s: (
                f"spec.schedule {s['schedule']} interleaves several stages per"
                " process: set stagesPerProcess to 2 or more"
                if s.get("schedule") in INTERLEAVING
                else "only the interleaved schedules (spec.schedule interleaved-1f1b or"
                " zero-bubble) hold several stages per process; spec.schedule is"
                f" {effective_schedule(s)}"
                + ("" if "schedule" in s else f", the default of spec.engine {s['engine']}")
            ),
        ),
        Rule(
            f"type(self.microBatches) == string || ({SCHEDULE_CEL} == '1f1b' ?"
            f" self.microBatches >= self.stages : ({SCHEDULE_CEL} in ['interleaved-1f1b',"
            " 'zero-bubble'] ? self.microBatches % self.stages == 0 : true))",
            "the schedule (spec.schedule) cannot run this many micro-batches: 1f1b needs at"
            " least stages, the interleaved schedules a multiple of stages",
            "microBatches",
            lambda s: (
                s["microBatches"] == AUTO
                or schedule_refuses(effective_schedule(s), s["stages"], s["microBatches"]) is None
            ),
            explain=lambda s: (
                "spec.schedule "
                + str(schedule_refuses(effective_schedule(s), s["stages"], s["microBatches"]))
            ),
        ),
        *COMMON_RULES,
    ),
)


@dataclass(frozen=True, kw_only=True)
class PipelineSpec(CommonSpec):
    model: Model  # a torchvision name is completed to Model(torchvision=name)
    stages: int
    replicas: Size  # the world runs at a size the plan gives; the batch is max's
    micro_batches: int | str  # a count, or AUTO
    batch_size: int
    image_size: int
    num_classes: int
    gpus_per_stage: int
    gradient_accumulation: int = 1
    precision: str = "fp32"
    activation_checkpointing: bool = False
    skip_non_finite_steps: int = 0
    split_points: tuple[str, ...] = ()
    data: PipelineData = PipelineData()
    engine: str = AUTO
    schedule: str = GPIPE  # completed from the engine when the spec leaves it out
    stages_per_process: int = 1
    ema: Ema | None = None

    @property
    def pieces(self) -> int:
        """What the model is cut into: every stage process holds stagesPerProcess pieces."""
        return self.stages * self.stages_per_process


def _completed(spec: RawSpec) -> RawSpec:
    """`model: resnet50` is short for `model: {torchvision: resnet50}`; a spec without a
    schedule runs its engine's."""
    if isinstance(spec.get("model"), str):
        spec["model"] = {"torchvision": spec["model"]}
    if "engine" in spec:
        spec["schedule"] = effective_schedule(spec)
    return spec


def _spec_errors(spec: RawSpec) -> list[SpecError]:
    """The model's own limits (model_facts.py), and data the model cannot read."""
    errors = model_facts.model_errors(spec)
    errors += micro_batch_errors(spec)
    tokens = spec["data"].get("tokens")
    if tokens is not None and "transformer" not in spec["model"] and "seqLen" not in tokens:
        errors.append(
            SpecError(
                "spec.data.tokens.seqLen",
                "required: the tokens per sample (only the built-in transformer, model.transformer,"
                " has a seqLen of its own)",
            )
        )
    return errors


PIPELINE_JOB = Kind(
    name="PipelineJob",
    plural="pipelinejobs",
    short_name="pj",
    description="PyTorch pipeline-parallel training: a master drives micro-batches "
    "through a chain of stage pods, over torch.distributed.rpc or torch.distributed.pipelining "
    "(spec.engine). The operator makes one pod per process and restarts the whole world when "
    "any pod fails.",
    spec=PIPELINE_SPEC,
    settings=PipelineSpec,
    roles=(
        Role("master"),
        Role(
            "stage",
            count="stages",
            gpus="gpus_per_stage",
            computes=True,
            replicas="replicas",
            # not the rpc engine named: one thread halves its speed for a few percent
            one_thread_when_crowded=lambda spec: spec.get("engine") != "rpc",
        ),
    ),
    groups=(
        ProcessGroup(
            "dp",
            "stage",
            backend=lambda world: "nccl" if world.gpus_per_stage else "gloo",
            by_index=True,
            when=lambda world: world.replicas.max > 1 and world.engine == RPC,
        ),
        # The pipelining engine: every stage of every replica in one group, which each
        # replica's pipeline (its P2P) and each stage's replicas (their all-reduce) divide.
        ProcessGroup(
            "pipe",
            "stage",
            backend=lambda world: "nccl" if world.gpus_per_stage else "gloo",
            when=lambda world: world.engine in (PIPELINING, AUTO),
        ),
    ),
    trainer="pipejob.trainer.pipeline",
    checks_first=True,
    columns=(
        column(
            "Perplexity",
            "number",
            ".status.training.evalPerplexity",
            "Perplexity on the held-out tokens at the last evaluation (the language model).",
        ),
        column(
            "Model",
            "string",
            ".spec.model",
            "The model as written: a torchvision name, or its object as JSON.",
        ),
        column("Stages", "integer", ".spec.stages"),
        column(
            "Engine",
            "string",
            ".status.engine",
            "The engine the job runs on: the one its master chose (spec.engine auto), else"
            " spec.engine.",
        ),
        column(
            "Replicas",
            "integer",
            ".status.replicas",
            "Copies of the pipeline the current world runs.",
        ),
    ),
    complete=_completed,
    check=_spec_errors,
    elastic="replicas",
    describe=lambda settings: [*path_lines(settings), engine_line(settings)],
    on_shared_gpus=on_rpc_where_gpus_are_shared,
)
