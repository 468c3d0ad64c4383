"""A checkpoint's state read by the model's own names, whatever cut wrote it: which file
holds each name (`index_of`, `sources`), and a module's share loaded from those files one at
a time, memory-mapped (`load_named`). The files and manifests: runtime/checkpoint.py; why:
docs/architecture.md, "Checkpoint files"."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict

import torch
from torch import nn

from pipejob.trainer.runtime.checkpoint import (
    Checkpoint,
    OptimizerLike,
    StateByName,
    load_optimizer_state,
    load_part,
)
from pipejob.trainer.runtime.checkpoint_format import ListedFile, RngState
from pipejob.trainer.runtime.failures import CheckpointError


class SavedBeside(TypedDict):
    """What a module's file holds beside its weights and optimizer state: the RNG state of
    the process that saved it (and the keywords its caller gave `save_module`)."""

    rng: RngState


def index_of(found: Checkpoint) -> dict[str, str]:
    """Which file holds each saved module state (a parameter or buffer, by the model's own
    name; the first file a name was saved in): the manifest's `index`, or, in a checkpoint
    written before it had one, the module files' own names."""
    if "index" in found.manifest:
        return found.manifest["index"]
    index: dict[str, str] = {}
    for entry in found.manifest["files"]:
        part = torch.load(found.directory / entry["name"], weights_only=False, mmap=True)
        if isinstance(part, dict) and isinstance(part.get("model"), dict):
            for name in part["model"]:
                index.setdefault(name, entry["name"])
    return index


def sources(found: Checkpoint, index: dict[str, str], names: list[str]) -> list[ListedFile]:
    """The manifest entries of the files that hold `names` (a module's state); refuses a
    module with names the checkpoint does not have (another model)."""
    if missing := [n for n in names if n not in index]:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(
            f"{found.directory} holds no {', '.join(missing[:5])}{more}: it was written for"
            " another model; give this job another checkpoint.path"
        )
    return [found.entry(f) for f in sorted({index[n] for n in names})]


def load_named(
    directory: str | Path,
    entries: list[ListedFile],
    module: nn.Module,
    optimizers: Mapping[str, OptimizerLike],
) -> list[SavedBeside]:
    """Load `module`'s state, each name from the first of the files `entries` that holds it
    (files `save_module` wrote for modules that may hold other parts of the model), and its
    optimizers' state (by key, as saved) for its parameters. One file at a time,
    memory-mapped: each name is copied into the module (and its optimizer state out) from the
    file, so no more of a file is read than the module's own share. The files' SHA-256 is
    not checked again (the master checked it: `latest`), their sizes are. Returns each file's
    other contents (RNG states, extras): a module cut as one of them may take its RNG."""
    targets = module.state_dict()  # the live tensors, under the module's own names
    params = {n for n, _ in module.named_parameters()}
    saved: dict[str, StateByName] = {key: {} for key in optimizers}
    found: set[str] = set()
    others: list[SavedBeside] = []
    for entry in entries:
        part = load_part(directory, entry, mmap=True, checksum=False)
        with torch.no_grad():
            for name, value in part["model"].items():
                if name in targets and name not in found:
                    if value.shape != targets[name].shape:
                        raise CheckpointError(
                            f"{Path(directory) / entry['name']} does not fit: {name} is"
                            f" {tuple(value.shape)} there, {tuple(targets[name].shape)} here"
                        )
                    targets[name].copy_(value)
                    found.add(name)
        for key, state in saved.items():  # copied out of the mapping below
            for name, tensors in part["optimizers"].get(key, {}).items():
                if name in params and name not in state:
                    state[name] = tensors
        others.append({k: v for k, v in part.items() if k not in ("model", "optimizers")})
        del part
    missing = sorted(set(targets) - found)
    if missing:
        names = ", ".join(entry["name"] for entry in entries)
        raise CheckpointError(f"{Path(directory)} ({names}) holds no {', '.join(missing[:5])}")
    for key, optim in optimizers.items():
        load_optimizer_state(optim, module, saved[key])
    return others
