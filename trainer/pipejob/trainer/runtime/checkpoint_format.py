"""What a checkpoint's files hold, as JSON and as saved: manifest.json (its head, the files it
lists, the kind's fields), a file's entry as its writer reports it, and the RNG state each
file keeps. The code that writes and reads them: runtime/checkpoint.py; the layout:
docs/architecture.md, "Checkpoint files"."""

from __future__ import annotations

from typing import TypedDict

import torch

from pipejob.trainer.runtime.json_values import JsonObject
from pipejob.trainer.runtime.model_files import ModelInfoBase


class ListedFile(TypedDict):
    """One file of a checkpoint as manifest.json lists it: its name, bytes and SHA-256."""

    name: str
    bytes: int
    sha256: str


class FileEntry(ListedFile, total=False):
    """A file as its writer reports it to the master: with `save_module`'s, the module
    states it holds (the manifest's `index` says them, its listed file does not)."""

    holds: list[str]


class ManifestFields(TypedDict, total=False):
    """What a kind's master adds to manifest.json (write_manifest's keywords)."""

    kind: str
    job: str
    model: JsonObject  # the spec's model section(s), as the spec writes them
    info: ModelInfoBase  # what model.json will say of the model (`pipejob export`)
    # PipelineJob (pipeline/master_checkpoints.py; pipeline/eager/saved.py: path "eager")
    stageCount: int
    stages: list[list[str]]
    engine: str
    schedule: str
    stagesPerProcess: int
    ranges: list[list[int]]
    costs: list[float]
    microBatches: int
    microBatchCandidates: list[JsonObject]
    replicas: int
    path: str
    placement: list[list[str]]
    # HybridJob (hybrid/board.py)
    trainerCount: int
    parameterServers: int
    metrics: dict[str, float]


class ManifestHead(TypedDict):
    """What every manifest.json begins with: its format, step, time and files."""

    format: int
    step: int
    time: float
    files: list[ListedFile]


class Manifest(ManifestHead, ManifestFields, total=False):
    """manifest.json: its head, which file holds each module state (absent in a checkpoint
    written before it had one), then the kind's fields."""

    index: dict[str, str]


class CpuRngState(TypedDict):
    """torch's CPU generator's state and Python's."""

    torch: torch.Tensor
    python: tuple[object, ...]


class RngState(CpuRngState, total=False):
    """This process's random generators (rng_state's): the CPU's and, where CUDA is in use,
    every GPU's."""

    cuda: list[torch.Tensor]
