"""spec.data of both kinds: where the samples come from (files, Criteo logs, the user's
Dataset, or none: synthetic data), as tables and as the typed objects the trainer reads
(trainer/workloads/ opens them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipejob.core.schema import Field
from pipejob.core.workload import (
    ARGS,
    RELATIVE,
    args_need_import,
    at_most_one,
    import_field,
    path_field,
)


@dataclass(frozen=True, kw_only=True)
class Split:
    """Where the data lives: a training set and, optionally, a held-out one."""

    train: str
    val: str | None = None


@dataclass(frozen=True, kw_only=True)
class Tokens(Split):
    dtype: str  # "uint16" or "uint32"
    seq_len: int | None = None  # the window; the transformer's seqLen when it is the model


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
    """At most one source; none is synthetic samples (datasetSize, bagSize, denseFeatures)."""

    file: Split | None = None  # .npz files with arrays ids, offsets, labels
    criteo: Split | None = None  # click logs in the Criteo layout (tab-separated text)
    import_: str | None = None  # called with split="train" / split="val" and `args`
    args: dict[str, Any] = field(default_factory=dict)


def _split_field(description: str, train: str, val: str, **fields: Field) -> Field:
    return Field(
        "object",
        description,
        fields={
            "train": path_field(train, "a file or folder"),
            "val": path_field(val, "a file or folder"),
            **fields,
        },
        required=("train",),
        section=True,
    )


PIPELINE_DATA = Field(
    "object",
    "What the pipeline trains on: at most one of imageFolder, tokens or import; none is"
    " synthetic data (random images, or random tokens for the transformer).",
    fields={
        "imageFolder": _split_field(
            "Images in torchvision's ImageFolder layout (one subfolder per class), with its"
            " standard transforms to imageSize.",
            "Folder of the training images." + RELATIVE,
            "Folder of the held-out images, for evaluation.",
        ),
        "tokens": _split_field(
            "A flat binary file of token ids (nanoGPT's format), read as windows of"
            " seqLen + 1 tokens: a sample's input is the first seqLen, its labels the next"
            " token at each position. For any model that takes token ids.",
            "Token file of the training set." + RELATIVE,
            "Token file of the held-out set, for evaluation.",
            dtype=Field(
                "string",
                "Type of one token id in the files.",
                default="uint16",
                enum=("uint16", "uint32"),
            ),
            seqLen=Field(
                "integer",
                "Tokens per sample; required unless the model is the"
                " built-in transformer, whose seqLen it defaults to.",
                minimum=1,
            ),
        ),
        "import": import_field(
            "a map-style torch Dataset; it is called with split='train' or split='val' too"
        ),
        "args": ARGS,
        "workers": Field(
            "integer",
            "DataLoader worker processes of each replica's first stage, which reads the batches.",
            default=2,
            minimum=0,
            maximum=32,
        ),
    },
    rules=(
        at_most_one(
            ("imageFolder", "tokens", "import"),
            "give at most one data source: imageFolder, tokens or import",
        ),
        args_need_import("data"),
    ),
)

HYBRID_DATA = Field(
    "object",
    "What the trainers train on: at most one of file, criteo or import; none is synthetic"
    " samples (datasetSize samples of up to bagSize ids per feature, and denseFeatures dense"
    " values with spec.embeddings).",
    fields={
        "file": _split_field(
            "Bags for spec.embedding's one table in .npz files (numpy.savez) with three"
            " arrays: ids (every bag's indices, concatenated), offsets (where each bag starts"
            " in ids) and labels (one class per bag).",
            "The training samples' .npz file." + RELATIVE,
            "The held-out samples' .npz file, for evaluation.",
        ),
        "criteo": _split_field(
            "Click logs in the Criteo layout (spec.embeddings), one sample a line, tab-separated:"
            " the label (0 or 1), 13 integer features (I1 ... I13, read as log(1 + x), an empty"
            " or negative one as 0) and 26 categorical features (C1 ... C26, hexadecimal"
            " strings, each hashed into its tables' rows; an empty one is 0).",
            "The training log's file." + RELATIVE,
            "The held-out log's file, for evaluation.",
        ),
        "import": import_field(
            "a map-style torch Dataset; it is called with split='train' or split='val' too."
            " With spec.embedding an item is (ids, label); with spec.embeddings it is (dense"
            " features, {feature: ids}, label) with a label of 0 or 1"
        ),
        "args": ARGS,
    },
    rules=(
        at_most_one(
            ("file", "criteo", "import"), "give at most one data source: file, criteo or import"
        ),
        args_need_import("data"),
    ),
)
