"""PipelineJob: a master drives micro-batches through a chain of stage pods (RPC pipeline
parallelism). Everything pipejob knows of the kind is declared here, once."""

from __future__ import annotations

from dataclasses import dataclass

from pipejob.core.common import COMMON, COMMON_RULES, CommonSpec, integer
from pipejob.core.kind import Group, Kind, Role, Spec
from pipejob.core.kinds import models
from pipejob.core.schema import Field, Rule, SpecError
from pipejob.core.workload import PIPELINE_DATA, Model, PipelineData, model_field

# Models whose torchvision structure the trainer knows how to cut into sequential layers.
PIPELINE_MODELS = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "wide_resnet50_2", "wide_resnet101_2",
    "vgg11", "vgg13", "vgg16", "vgg19", "vgg11_bn", "vgg13_bn", "vgg16_bn", "vgg19_bn",
    "alexnet", "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large",
    "efficientnet_b0", "efficientnet_b1", "convnext_tiny",
)  # fmt: skip

AUTO = "auto"  # spec.microBatches: the master chooses the count


PIPELINE_SPEC = Field(
    "object",
    "A pipeline-parallel job: a master drives micro-batches through `stages` RPC workers.",
    fields={
        "model": model_field(PIPELINE_MODELS, default="resnet50"),
        "stages": integer("Pipeline stages, one pod each.", default=2, minimum=2, maximum=64),
        "splitPoints": Field(
            "array",
            "Where the model is cut: the module names (as in named_modules(), at any depth,"
            " e.g. layer3.1 or transformer.h.6) where stage 1, 2, ... begin; stages - 1 of"
            " them, each once, in the model's order. Without them the cut is chosen"
            " automatically, balanced by measured cost.",
            items=Field("string", "A module name where a stage begins.", max_length=253),
            max_items=63,
        ),
        "data": PIPELINE_DATA,
        "replicas": integer(
            "Copies of the pipeline, each on its own share of every batch (data parallel):"
            " stage i of every replica averages its gradients with the others' before each"
            " optimizer step, so the replicas stay identical.",
            default=1, minimum=1, maximum=64,
        ),
        "microBatches": Field(
            "int-or-string",
            "Micro-batches each batch is split into, or `auto`: the stages measure the"
            " model's layers at each candidate count (powers of two dividing batchSize, with"
            " micro-batches of at least 2) and runs the one with the shortest predicted step.",
            default=4, minimum=1, pattern=AUTO,
        ),
        "batchSize": integer("Images per batch (per step).", default=32, minimum=1),
        "imageSize": integer(
            "Height and width of the square input images.", default=224, minimum=32, maximum=1024
        ),
        "numClasses": integer("Classes of the classifier head.", default=1000, minimum=2),
        "gpusPerStage": integer(
            "GPUs per stage pod (nvidia.com/gpu): 0 runs on CPU, 1 on a GPU (a stage uses one).",
            default=0, maximum=1,
        ),
        "gradientAccumulation": integer(
            "Batches per optimizer step: their gradients add up (each batch's loss weighted"
            " 1/gradientAccumulation), so a step equals one on a gradientAccumulation times"
            " bigger batch, with the memory of one batch.",
            default=1, minimum=1, maximum=1024,
        ),
        "precision": Field(
            "string", "What the stages compute in: fp32; bf16 (autocast, on CPU and GPU); or"
            " fp16 (autocast with loss scaling, GPU only). Weights and optimizer state stay"
            " float32.",
            default="fp32", enum=("fp32", "bf16", "fp16"),
        ),
        "skipNonFiniteSteps": integer(
            "Steps whose loss or gradient norm is not finite (NaN or infinite) that may be"
            " skipped, their update not applied, before the job fails. 0, the default: the"
            " first one fails the job permanently (reason NonFinite), naming the step, the"
            " stage where the first non-finite value came from and the value, with its last"
            " checkpoint kept and no output written. With fp16, a step whose gradients"
            " overflow is skipped by the loss scaling and is not counted.",
            default=0, minimum=0,
        ),
        "activationCheckpointing": Field(
            "boolean", "Each stage keeps only its inputs in the forward and recomputes its"
            " activations in the backward: less memory for about one more forward.",
            default=False,
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
        Rule(
            "!has(self.splitPoints) || size(self.splitPoints) == self.stages - 1",
            "must list stages - 1 module names, where stage 1, 2, ... begin",
            "splitPoints",
            lambda s: "splitPoints" not in s or len(s["splitPoints"]) == s["stages"] - 1,
            message_expression="'must list stages - 1 = ' + string(self.stages - 1) + ' module"
            " names, where stage 1, 2, ... begin; got ' + string(size(self.splitPoints))",
            explain=lambda s: f"must list stages - 1 = {s['stages'] - 1} module names, where"
            f" stage 1, 2, ... begin; got {len(s['splitPoints'])}",
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
        *COMMON_RULES,
    ),
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class PipelineSpec(CommonSpec):
    model: Model  # a torchvision name is completed to Model(torchvision=name)
    stages: int
    replicas: int
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


def _complete(spec: Spec) -> Spec:
    """`model: resnet50` is short for `model: {torchvision: resnet50}`."""
    if isinstance(spec.get("model"), str):
        spec["model"] = {"torchvision": spec["model"]}
    return spec


def _check(spec: Spec) -> list[SpecError]:
    """The model's own limits (models.py), and data the model cannot read."""
    errors = models.check(spec)
    tokens = spec["data"].get("tokens")
    if tokens is not None and "transformer" not in spec["model"] and "seqLen" not in tokens:
        errors.append(SpecError(
            "spec.data.tokens.seqLen",
            "required: the tokens per sample (only the built-in transformer has a seqLen of"
            " its own)",
        ))  # fmt: skip
    return errors


PIPELINE_JOB = Kind(
    name="PipelineJob",
    plural="pipelinejobs",
    short_name="pj",
    description="PyTorch RPC pipeline-parallel training: a master drives micro-batches "
    "through a chain of stage pods. The operator makes one pod per process and restarts the "
    "whole world when any pod fails.",
    spec=PIPELINE_SPEC,
    settings=PipelineSpec,
    roles=(
        Role("master"),
        Role(
            "stage",
            count=lambda spec: spec["stages"],
            gpus="gpusPerStage",
            computes=True,
            replicas=lambda spec: spec["replicas"],
        ),
    ),
    groups=(
        Group(
            "dp",
            "stage",
            backend=lambda spec: "nccl" if spec["gpusPerStage"] else "gloo",
            by_index=True,
            when=lambda spec: spec["replicas"] > 1,
        ),
    ),
    trainer="pipejob.trainer.pipeline",
    columns=(
        {
            "name": "Perplexity",
            "type": "number",
            "jsonPath": ".status.training.evalPerplexity",
            "priority": 1,
            "description": "Perplexity on the held-out tokens at the last evaluation"
            " (the language model).",
        },
        {
            "name": "Model",
            "type": "string",
            "jsonPath": ".spec.model",
            "priority": 1,
            "description": "The model as written: a torchvision name, or its object as JSON.",
        },
        {"name": "Stages", "type": "integer", "jsonPath": ".spec.stages", "priority": 1},
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas", "priority": 1},
    ),
    complete=_complete,
    check=_check,
)
