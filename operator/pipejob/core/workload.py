"""What a job trains, as the spec says it: the model, the loss, the evaluation and the output
(spec.data is core/data_sources.py), as field tables and as the torch-free objects the
trainer reads; and the fields every user hook is named by, an import path
"package.module:function" called with `args`. docs/architecture.md, "Adding a model"."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipejob.core.best_model import BEST, EARLY_STOPPING, Best, EarlyStopping
from pipejob.core.schema import Field, Rule, integer

# "package.module:function": dotted identifiers, one colon.
IMPORT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"  # noqa: E501


@dataclass(frozen=True, kw_only=True)
class Transformer:
    """pipejob's own decoder-only language model."""

    vocab_size: int
    layers: int
    width: int
    heads: int
    seq_len: int


@dataclass(frozen=True, kw_only=True)
class Staged:
    """How the user stages the model, past the tracer: the model's modules in order, each
    taking what the previous returned (`layers`), or a function building stage i of n
    (`stage`, "package.module:function")."""

    layers: tuple[str, ...] = ()
    stage: str | None = None


@dataclass(frozen=True, kw_only=True)
class Model:
    """Exactly one of: a torchvision name, the built-in transformer, a user's factory; or
    none of them where `staged.stage` builds the stages."""

    torchvision: str | None = None
    transformer: Transformer | None = None
    import_: str | None = None  # spec key "import"
    args: dict[str, Any] = field(default_factory=dict)
    staged: Staged | None = None
    cut: str | None = None  # None: auto (traced, else eager where the trace is refused)


# spec.model.cut: how the model is run across the stages.
CUT_AUTO, CUT_TRACED, CUT_EAGER = "auto", "traced", "eager"


@dataclass(frozen=True, kw_only=True)
class Loss:
    import_: str | None = None  # None: cross-entropy
    args: dict[str, Any] = field(default_factory=dict)
    cross_entropy: CrossEntropy | None = None


@dataclass(frozen=True, kw_only=True)
class CrossEntropy:
    """spec.loss.crossEntropy: the built-in loss's options."""

    label_smoothing: float = 0.0
    ignore_index: int = -100


@dataclass(frozen=True, kw_only=True)
class Eval:
    every_steps: int = 0  # 0: only at the end
    batches: int = 0  # held-out batches per evaluation; 0: the whole held-out set
    best: Best | None = None
    early_stopping: EarlyStopping | None = None


@dataclass(frozen=True, kw_only=True)
class Output:
    path: str  # a directory: the model files and their JSON sidecar go in it
    format: str = "safetensors"  # or "torch"
    merged: bool = False  # a peft model: its adapters merged in, in merged/


# --- the field tables ---------------------------------------------------------------------

_IMPORT_BODY = IMPORT_PATTERN.removeprefix("^").removesuffix("$")  # Field adds ^...$ itself
_IMPORT_SAYS = (
    "be an import path 'package.module:function' (dotted Python names, one colon before the"
    " function)"
)


def import_field(returns: str) -> Field:
    """`import`: the user's factory, "package.module:function"."""
    return Field(
        "string",
        f"The user's factory as an import path, package.module:function; it is called with"
        f" `args` as keyword arguments and returns {returns}. The module must be importable"
        " in the trainer: in the image, on PYTHONPATH, or (with `pipejob run`) in the"
        " manifest's folder.",
        pattern=_IMPORT_BODY,
        pattern_says=_IMPORT_SAYS,
        max_length=1024,
    )


ARGS = Field(
    "object",
    "Keyword arguments of the function named by `import` (only with `import`), passed as written.",
    free_form=True,
)


def args_need_import(what: str) -> Rule:
    return Rule(
        "!has(self.args) || has(self.__import__)",
        f"args are the keyword arguments of {what}.import: set import too, or leave args out",
        "args",
        lambda o: "args" not in o or "import" in o,
    )


def at_most_one(names: tuple[str, ...], message: str, path: str = "") -> Rule:
    """At most one of `names` (spec keys) is given."""
    cel = " + ".join(f"(has(self.{_cel_name(n)}) ? 1 : 0)" for n in names) + " <= 1"
    return Rule(cel, message, path, lambda o: sum(n in o for n in names) <= 1)


def exactly_one(names: tuple[str, ...], message: str) -> Rule:
    cel = " + ".join(f"(has(self.{_cel_name(n)}) ? 1 : 0)" for n in names) + " == 1"
    return Rule(cel, message, "", lambda o: sum(n in o for n in names) == 1)


def _cel_name(key: str) -> str:
    """A property name as CEL reads it: the API server escapes CEL's keywords as __kw__."""
    return f"__{key}__" if key in ("import", "in", "as", "package", "namespace") else key


TRANSFORMER = Field(
    "object",
    "pipejob's own decoder-only transformer language model (token embedding, `layers`"
    " pre-norm blocks, a final norm and the output head), trained on next-token cross-entropy.",
    fields={
        "vocabSize": integer("Tokens in the vocabulary (256 for bytes).", default=256, minimum=1),
        "layers": integer("Transformer blocks.", default=4, minimum=1),
        "width": integer("Embedding width; divisible by heads.", default=128, minimum=1),
        "heads": integer("Attention heads per block.", default=4, minimum=1),
        "seqLen": integer("Tokens per sample (the context length).", default=128, minimum=1),
    },
    rules=(
        Rule(
            "self.width % self.heads == 0",
            "width must be divisible by heads (each head gets width / heads dimensions)",
            "heads",
            lambda o: o["width"] % o["heads"] == 0,
        ),
    ),
    section=True,
)


def model_field(torchvision: tuple[str, ...], default: str) -> Field:
    """A PipelineJob's `model`: a torchvision name, or an object with exactly one source."""
    return Field(
        "string-or-object",
        "The model to train, cut into stages. A string is a torchvision classification model"
        " by name (short for {torchvision: name}); an object has exactly one of `torchvision`,"
        " `transformer` (pipejob's own language model) or `import` (the user's factory, with"
        " `args`); `staged` says how the model is staged where no tracer can read it. Kept as"
        " written by the API server (a string or an object); pipejob validate and the"
        f" operator check it. The torchvision names: {', '.join(torchvision)}.",
        default=default,
        enum=torchvision,
        fields={
            "torchvision": Field(
                "string", "A torchvision classification model by name.", enum=torchvision
            ),
            "transformer": TRANSFORMER,
            "import": import_field("a torch.nn.Module"),
            "args": ARGS,
            "staged": STAGED,
            "cut": Field(
                "string",
                "How the model runs across the stages. `traced`: the model's forward traced"
                " and cut into a compiled part per stage (fast; refused where the trace"
                " cannot read the glue). `eager`: the master runs the model's own forward on"
                " real tensors and calls its costly submodules where they live on the"
                " stages (whatever runs in one process; rpc engine only). `auto` (the"
                " default): traced, or eager where the trace is refused; the run's summary"
                " says which and why.",
                enum=(CUT_AUTO, CUT_TRACED, CUT_EAGER),
            ),
        },
        rules=(
            _one_source_rule(),
            Rule(
                "!has(self.args) || has(self.__import__) || (has(self.staged) &&"
                " has(self.staged.stage))",
                "args are the keyword arguments of model.import (or model.staged.stage): set"
                " import too, or leave args out",
                "args",
                lambda o: "args" not in o or "import" in o or "stage" in o.get("staged", {}),
            ),
        ),
    )


def _one_source_rule() -> Rule:
    """Exactly one of torchvision, transformer or import; or none where staged.stage builds
    the stages (the model is then the stages in order)."""
    names = ("torchvision", "transformer", "import")
    count = " + ".join(f"(has(self.{_cel_name(n)}) ? 1 : 0)" for n in names)
    return Rule(
        f"{count} == 1 || ({count} == 0 && has(self.staged) && has(self.staged.stage))",
        "give exactly one of torchvision, transformer or import (or none, with staged.stage)",
        "",
        lambda o: (
            sum(n in o for n in names) == 1
            or (sum(n in o for n in names) == 0 and "stage" in o.get("staged", {}))
        ),
    )


STAGED = Field(
    "object",
    "How the model is staged, past the tracer, for glue between modules that the automatic"
    " cut cannot trace (data-dependent Python, packed sequences, libraries that inspect"
    " tensor types): exactly one of `layers` (DeepSpeed's PipelineModule style) or `stage`"
    " (torchtitan's style). Parameter names stay the model's, so the output loads into it.",
    fields={
        "layers": Field(
            "array",
            "Module names of the model (as in named_modules()), in order: the model is these"
            " modules called one after another, each with what the previous returned (a"
            " tuple as positional arguments); its own forward is not used. A plain"
            " Sequential, ModuleList or ModuleDict named opens into its items. Stages begin"
            " at any of them (splitPoints, or balanced by measured cost).",
            items=Field("string", "A module name of the model.", max_length=253),
            max_items=4096,
        ),
        "stage": Field(
            "string",
            "A function building stage i of n, package.module:function, called with"
            " stage=i, stages=n and the model's `args` under spec.seed; each process builds"
            " only its own stages. With `import` (the whole model) its modules must hold"
            " their parameters under the whole model's names; without, stage i's names are"
            " prefixed with `i.` (the output loads into nn.Sequential of the stages).",
            pattern=_IMPORT_BODY,
            pattern_says=_IMPORT_SAYS,
            max_length=1024,
        ),
    },
    rules=(exactly_one(("layers", "stage"), "give exactly one of layers or stage"),),
    section=True,
)


# A path a process opens: an empty one (or blanks) names nothing and is refused as such.
NON_EMPTY = r".*\S.*"


def path_field(description: str, what: str) -> Field:
    return Field(
        "string", description, pattern=NON_EMPTY, pattern_says=f"name {what}", max_length=4096
    )


RELATIVE = " A relative path is relative to the manifest's folder with `pipejob run`."

CROSS_ENTROPY = Field(
    "object",
    "The built-in cross-entropy's options (torch.nn.functional.cross_entropy's).",
    fields={
        "labelSmoothing": Field(
            "number",
            "Mix each target with the uniform distribution by this much (timm's and the HF"
            " Trainer's label_smoothing).",
            default=0.0,
            minimum=0,
            maximum=1,
        ),
        "ignoreIndex": Field(
            "integer",
            "A label the loss leaves out (padding, a prompt's tokens): the mean is over the"
            " other labels of each micro-batch.",
            default=-100,
            minimum=-(2**31),
            maximum=2**31 - 1,
        ),
    },
    section=True,
)

LOSS = Field(
    "object",
    "The loss: cross-entropy (per token for the language model) unless `import` names the user's.",
    fields={
        "import": import_field("a callable loss(output, target) -> scalar tensor"),
        "args": ARGS,
        "crossEntropy": CROSS_ENTROPY,
    },
    rules=(
        args_need_import("loss"),
        at_most_one(
            ("import", "crossEntropy"),
            "crossEntropy sets the built-in loss's options: with import, give your loss its"
            " own args",
            "crossEntropy",
        ),
    ),
)

EVAL = Field(
    "object",
    "Evaluate on the held-out data (the data source's val) every few steps and at the end:"
    " loss, and accuracy for classification or perplexity for the language model.",
    fields={
        "everySteps": Field(
            "integer",
            "Evaluate every this many steps; 0 evaluates only at the end.",
            default=0,
            minimum=0,
        ),
        "batches": Field(
            "integer",
            "Held-out batches per evaluation; 0 evaluates the whole held-out set.",
            default=0,
            minimum=0,
        ),
        "best": BEST,
        "earlyStopping": EARLY_STOPPING,
    },
    rules=(
        Rule(
            "!has(self.earlyStopping) || has(self.best)",
            "earlyStopping watches best's metric: give best too (best: {} for the loss)",
            "earlyStopping",
            lambda o: "earlyStopping" not in o or "best" in o,
        ),
    ),
    section=True,
)

OUTPUT = Field(
    "object",
    "Write the trained model at the end under the original model's parameter names"
    " (loadable with load_state_dict(strict=True)), beside a JSON of the model spec and the"
    " final metrics: one file, or, for a PipelineJob model over 256 MiB, one shard per stage"
    " with an index in Hugging Face's layout.",
    fields={
        "path": path_field(
            "Directory the model files and their JSON go in. Each stage writes its own shard"
            " of a sharded model: on a cluster, a volume every pod shares." + RELATIVE,
            "a directory",
        ),
        "format": Field(
            "string",
            "File format: safetensors, or torch's own (torch.save).",
            default="safetensors",
            enum=("safetensors", "torch"),
        ),
        "merged": Field(
            "boolean",
            "For a peft model (LoRA), also the model with its adapters merged into"
            " its weights, under the base model's names, as a Hugging Face model folder"
            " `merged/`. A peft model's adapters are always written too, as"
            " PeftModel.save_pretrained writes them (adapter_model.safetensors,"
            " adapter_config.json). PipelineJob only.",
            default=False,
        ),
    },
    required=("path",),
    section=True,
)
