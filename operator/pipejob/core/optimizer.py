"""spec.optimizer, which every kind has: its table (each bound the loosest torch.optim puts
on the field, core/bounds.py), its parameter groups (`groups`, `layerDecay`: which weight
decay and learning rate each parameter gets) and the typed `Optimizer` the trainer steps with."""

from __future__ import annotations

from dataclasses import dataclass

from pipejob.core import bounds
from pipejob.core.schema import Field, Rule, integer


def _torch_bounds(field: str) -> dict[str, float | bool | None]:
    """A spec.optimizer field's bound: the loosest torch.optim's classes put on it (bounds.py)."""
    return bounds.loosest(bounds.OPTIMIZERS, field).schema()


# A parameter's name pattern (fnmatch: *, ?, [seq]) as named_parameters() names it.
PATTERN = Field(
    "string",
    "A parameter name pattern (fnmatch: `*` any text, dots included; `?`; `[seq]`).",
    pattern=r".*\S.*",
    pattern_says="be a name pattern",
    max_length=253,
)
NO_DECAY = "noDecay"  # the preset: 1-D parameters (norms' weights, biases) and any *.bias

GROUP = Field(
    "object",
    "One parameter group. A parameter is in the first group whose every condition (preset,"
    " params, maxDims) holds; one in none gets the optimizer's own weightDecay and lr.",
    fields={
        "name": Field(
            "string",
            "The group's name, as the summary counts its parameters.",
            pattern=r"^[A-Za-z0-9]([-_.A-Za-z0-9]*[A-Za-z0-9])?$",
            pattern_says="be letters, digits, '-', '_' or '.' (starting and ending with one"
            " of the first two)",
            max_length=63,
        ),
        "preset": Field(
            "string",
            f"{NO_DECAY}: every parameter of at most 1 dimension and every bias (timm's"
            " param_groups_weight_decay, nanoGPT's dim < 2, the HF Trainer's biases and"
            " norms), with weightDecay 0 unless given.",
            enum=(NO_DECAY,),
        ),
        "params": Field(
            "array",
            "Name patterns: the parameter's name matches one of them.",
            items=PATTERN,
            min_items=1,
            max_items=256,
        ),
        "maxDims": integer("The parameter has at most this many dimensions.", maximum=64),
        "weightDecay": Field(
            "number",
            "The group's weight decay (default: the optimizer's; 0 with preset noDecay).",
            **_torch_bounds("weightDecay"),
        ),
        "lrScale": Field(
            "number",
            "The group's learning rate is lr (as scheduled) times this.",
            default=1.0,
            minimum=0,
            exclusive_minimum=True,
        ),
    },
    required=("name",),
    rules=(
        Rule(
            "has(self.preset) || has(self.params) || has(self.maxDims)",
            "a group needs a preset, params or maxDims to say which parameters it holds",
            "",
            lambda o: any(k in o for k in ("preset", "params", "maxDims")),
        ),
        Rule(
            "!has(self.preset) || !(has(self.params) || has(self.maxDims))",
            "a preset says which parameters the group holds: leave params and maxDims out",
            "preset",
            lambda o: "preset" not in o or not ("params" in o or "maxDims" in o),
        ),
    ),
)

GROUPS = Field(
    "array",
    "Parameter groups (torch.optim's param_groups), each with its own weightDecay and"
    " learning-rate multiplier; each stage builds them over its own parameters by their"
    " names in the whole model, so a run steps as torch.optim with the same groups in one"
    " process. Omit for one group of every parameter.",
    items=GROUP,
    min_items=1,
    max_items=64,
    list_map_keys=("name",),
)

LAYER_DECAY = Field(
    "object",
    "Layer-wise learning-rate decay (BEiT, timm's layer_decay): block i (0-based) of"
    " `layers` gets lr times rate ** (layers - i), the stem rate ** (layers + 1), every other"
    " parameter (the head, a final norm) lr; on top of its group's lrScale.",
    fields={
        "rate": Field(
            "number", "The decay per block.", minimum=0, exclusive_minimum=True, maximum=1
        ),
        "layers": integer("How many blocks the model has.", minimum=1, maximum=100000),
        "blocks": Field(
            "string",
            "The blocks' container: a parameter named `<blocks>.<i>.…` is in block i"
            " (nanoGPT: transformer.h; timm's ViT: blocks; BERT: bert.encoder.layer).",
            pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$",
            pattern_says="be a module name (names joined by dots)",
            max_length=253,
        ),
        "stem": Field(
            "array",
            "Name patterns of the stem, below block 0 (embeddings, patch_embed, cls_token).",
            items=PATTERN,
            default=[],
            max_items=256,
        ),
    },
    required=("rate", "layers", "blocks"),
    section=True,
)

OPTIMIZER = Field(
    "object",
    "The optimizer every parameter is stepped with: a PipelineJob's by each stage, where its"
    " parameters live; a HybridJob's dense layers by each trainer's own (its tables by"
    " spec.sparseOptimizer, on the parameter servers).",
    fields={
        "name": Field(
            "string",
            "Optimizer from torch.optim.",
            default="sgd",
            enum=tuple(bounds.OPTIMIZERS),
        ),
        "lr": Field("number", "Learning rate.", default=0.05, **_torch_bounds("lr")),
        "momentum": Field(
            "number", "Momentum (sgd and rmsprop only).", default=0.0, **_torch_bounds("momentum")
        ),
        "weightDecay": Field(
            "number", "L2 weight decay.", default=0.0, **_torch_bounds("weightDecay")
        ),
        "beta1": Field(
            "number",
            "Adam's and AdamW's beta1 (the gradient's running average), torch's default.",
            default=0.9,
            **_torch_bounds("beta1"),
        ),
        "beta2": Field(
            "number",
            "Adam's and AdamW's beta2 (the squared gradient's running average), torch's"
            " default; nanoGPT uses 0.95.",
            default=0.999,
            **_torch_bounds("beta2"),
        ),
        "groups": GROUPS,
        "layerDecay": LAYER_DECAY,
        "clipGradNorm": Field(
            "number",
            "Clip the gradients to this global L2 norm before each optimizer step:"
            " the norm over every parameter of the whole model (every stage; with replicas,"
            " after their average), as torch.nn.utils.clip_grad_norm_ on the model in one"
            " process. Omit it to step unclipped.",
            minimum=0,
            exclusive_minimum=True,
        ),
        "schedule": Field(
            "object",
            "How the learning rate changes per optimizer step: linear warmup from lr /"
            " warmupSteps to lr over the first warmupSteps steps, then `decay` from lr to"
            " minLr over the remaining steps. Omit it for a constant lr.",
            fields={
                "warmupSteps": integer("Optimizer steps of linear warmup.", default=0),
                "decay": Field(
                    "string",
                    "After the warmup: keep lr (constant), or decay it"
                    " to minLr linearly or along a half cosine.",
                    default="constant",
                    enum=("constant", "linear", "cosine"),
                ),
                "minLr": Field(
                    "number",
                    "The learning rate the decay ends at (after the last step).",
                    default=0.0,
                    minimum=0,
                ),
            },
            section=True,
        ),
    },
    rules=(
        Rule(
            "self.name in ['adam', 'adamw'] || (self.beta1 == 0.9 && self.beta2 == 0.999)",
            "only adam and adamw have betas: leave beta1 and beta2 out",
            "beta1",
            lambda o: o["name"] in ("adam", "adamw") or (o["beta1"], o["beta2"]) == (0.9, 0.999),
        ),
        Rule(
            "!(self.name in ['adam', 'adamw']) || self.momentum == 0.0",
            "adam and adamw have no momentum (they use betas): leave momentum out",
            "momentum",
            lambda o: o["name"] not in ("adam", "adamw") or o["momentum"] == 0.0,
        ),
        Rule(
            "!has(self.schedule) || self.schedule.minLr <= self.lr",
            "schedule.minLr must be at most lr (the decay goes down from lr to minLr)",
            "schedule.minLr",
            lambda o: "schedule" not in o or o["schedule"]["minLr"] <= o["lr"],
        ),
    ),
)


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    """spec.optimizer, as every stage and trainer steps with it (trainer/runtime/optim.py)."""

    name: str
    lr: float
    momentum: float
    weight_decay: float
    beta1: float = 0.9
    beta2: float = 0.999
    groups: tuple[Group, ...] = ()
    layer_decay: LayerDecay | None = None
    clip_grad_norm: float | None = None
    schedule: Schedule | None = None


@dataclass(frozen=True, kw_only=True)
class Group:
    """One of spec.optimizer.groups (trainer/runtime/param_groups.py assigns parameters)."""

    name: str
    preset: str | None = None
    params: tuple[str, ...] = ()
    max_dims: int | None = None
    weight_decay: float | None = None
    lr_scale: float = 1.0


@dataclass(frozen=True, kw_only=True)
class LayerDecay:
    """spec.optimizer.layerDecay."""

    rate: float
    layers: int
    blocks: str
    stem: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """spec.optimizer.schedule: warmup, then the decay to min_lr."""

    warmup_steps: int
    decay: str
    min_lr: float
