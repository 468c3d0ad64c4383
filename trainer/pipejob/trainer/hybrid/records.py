"""The records a HybridJob's roles hand each other over RPC and write: where a resumed run
starts (`Resume`), a trainer's results (`TrainerResults`, whose `TrainerFigures` the summary
keeps), a held-out evaluation (`HeldOutFigures`, and `Evaluation` as the summary and the
checkpoints keep it), the run's summary (`HybridSummary`), and a parameter server's: what
it made (`ServerSize`), its figures (`ServerFigures`) and its checkpoint file
(`SavedServer`). JSON we write is a TypedDict (its keys are the format); what code builds
and reads is a frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NotRequired, TypedDict

import torch

from pipejob.trainer.runtime.checkpoint import TorchState
from pipejob.trainer.runtime.checkpoint_format import FileEntry
from pipejob.trainer.runtime.memory import Peak
from pipejob.trainer.runtime.roles import SummaryBase


@dataclass(frozen=True)
class Resume:
    """What the trainers need to continue after a checkpoint's step (master._resume): its
    directory, the dense model's file and the replicated tables' (if any), and the data's
    position (samples consumed, at any trainer count)."""

    step: int
    directory: str
    dense: FileEntry
    replicated: FileEntry | None
    samples: int


class TrainerFigures(TypedDict):
    """A trainer's figures, as the summary's perTrainer keeps them."""

    ddpRank: int
    steps: int
    batchSize: int
    seconds: float
    samplesPerSecond: float
    firstLoss: float
    finalLoss: float
    denseChangeNorm: float
    share: int
    samplesRead: int
    readerPeakBytes: int | None  # click logs: the most bytes of lines the reader held at once


@dataclass(frozen=True)
class TrainerResults:
    """A trainer's results for the master (trainer.train): its figures, the (epoch, sample)
    pairs it read (sorted, once each), its dense weights and its replicated tables."""

    figures: TrainerFigures
    read: torch.Tensor
    dense: dict[str, torch.Tensor]
    replicated: dict[str, torch.Tensor]


@dataclass(frozen=True)
class HeldOutFigures:
    """A held-out evaluation's figures (evaluate.evaluate): the mean loss over `samples`,
    accuracy (classes) or AUC (clicks), None where it does not apply."""

    loss: float
    samples: int
    accuracy: float | None
    auc: float | None


class Evaluation(TypedDict):
    """The latest held-out evaluation, with its step, as the summary and the checkpoints'
    metrics keep it."""

    evalStep: int
    evalLoss: float
    evalAccuracy: float | None
    evalAuc: float | None
    evalSamples: int


class ServerCounts(TypedDict):
    """A server's figures, as the summary's perServer keeps them."""

    rowsUpdated: int
    steps: int


class HybridSummary(SummaryBase):
    """A HybridJob's summary (JSON; the keys in this order, runtime/roles.py's first): the
    run's figures are absent where the checkpoint already held every step; the evaluation's
    where there was none; `losses` once the master adds them, `output` with spec.output."""

    trainers: NotRequired[int]
    parameterServers: NotRequired[int]
    batchSize: NotRequired[int]
    seconds: NotRequired[float]
    samplesPerSecond: NotRequired[float]
    firstLoss: NotRequired[float]
    finalLoss: NotRequired[float]
    denseMaxAbsDiff: NotRequired[float]
    embeddingNormBefore: NotRequired[float]
    embeddingChangeNorm: NotRequired[float]
    samplesRepeated: NotRequired[int]
    evalStep: NotRequired[int]
    evalLoss: NotRequired[float]
    evalAccuracy: NotRequired[float | None]
    evalAuc: NotRequired[float | None]
    evalSamples: NotRequired[int]
    perTrainer: NotRequired[dict[str, TrainerFigures]]
    perServer: NotRequired[dict[str, ServerCounts]]
    memory: NotRequired[dict[str, Peak]]
    losses: NotRequired[list[float]]
    output: NotRequired[list[str]]


class ServerFigures(TypedDict):
    """A server's figures for the summary (`Server.figures`)."""

    initialSquares: float
    changeSquares: float
    steps: int
    rowsUpdated: int


class SavedShard(TypedDict):
    """A shard in a server's checkpoint file: its table, rows start..stop-1 from column
    `column`, its weight and its rows of the optimizer's state."""

    table: str
    start: int
    stop: int
    column: NotRequired[int]  # absent in a file of before columns: 0
    weight: torch.Tensor
    state: TorchState


class SavedServer(TypedDict):
    """A server's checkpoint file (ps<i>.pt): the sparse optimizer's name and the shards
    ("pieces": the file's key since before shards had their name)."""

    optimizer: str
    pieces: list[SavedShard]


class ServerSize(TypedDict):
    """What a server made (`start`): its shards and their values."""

    pieces: int
    parameters: int
