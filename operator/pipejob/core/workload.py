"""What a job trains, as the spec says it: the model, the data, the loss, the evaluation and
the output. Torch-free: the trainer reads these typed objects (trainer/workloads/ makes the
real things from them); validation and the CRDs read the field tables.

Every user hook is an import path, "package.module:function", whose function is called with
`args` and returns the thing (an nn.Module, a Dataset, a loss callable)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
class Model:
    """Exactly one of: a torchvision name, the built-in transformer, a user's factory."""

    torchvision: str | None = None
    transformer: Transformer | None = None
    import_: str | None = None  # spec key "import"
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Split:
    """Where the data lives: a training set and, optionally, a held-out one."""

    train: str
    val: str | None = None


@dataclass(frozen=True, kw_only=True)
class Tokens(Split):
    dtype: str  # "uint16" or "uint32"


@dataclass(frozen=True, kw_only=True)
class PipelineData:
    """At most one source; none is synthetic data."""

    image_folder: Split | None = None
    tokens: Tokens | None = None
    import_: str | None = None  # called with split="train" / split="val" and `args`
    args: dict[str, Any] = field(default_factory=dict)
    workers: int = 2  # DataLoader worker processes


@dataclass(frozen=True, kw_only=True)
class HybridData:
    """At most one source; none is synthetic bags (datasetSize, bagSize)."""

    file: Split | None = None  # .npz files with arrays ids, offsets, labels
    import_: str | None = None  # called with split="train" / split="val" and `args`
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Loss:
    import_: str | None = None  # None: cross-entropy
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Eval:
    every_steps: int = 0  # 0: only at the end
    batches: int = 0  # held-out batches per evaluation; 0: the whole held-out set


@dataclass(frozen=True, kw_only=True)
class Output:
    path: str  # a directory: the model file and its JSON sidecar go in it
    format: str = "safetensors"  # or "torch"
