"""Checkpoints that a crash can never leave half-used: `<path>/step-NNNNNNNN/` holds one file
per part of the world and `manifest.json`, written last, with each file's size and SHA-256;
every file is written atomically. State is saved under the model's own names, so a world
cut another way resumes it (runtime/state_by_name.py). The layout, the writes and the
optimizer state: docs/architecture.md, "Checkpoint files"."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, Unpack

import torch
from torch import nn

from pipejob.core.common_spec import CommonSpec
from pipejob.trainer.runtime import world
from pipejob.trainer.runtime.checkpoint_format import (
    FileEntry,
    ListedFile,
    Manifest,
    ManifestFields,
    RngState,
)
from pipejob.trainer.runtime.failures import CheckpointError
from pipejob.trainer.runtime.world import Env

MANIFEST = "manifest.json"
FORMAT = 1
KEEP = 2  # complete checkpoints kept; older step directories are removed
# What torch's state_dict() gives and load_state_dict() takes (a module's, an optimizer's, the
# random generators'): torch's own untyped shape, the trainer's one boundary of that kind.
TorchState = dict[str, Any]
# An optimizer's state by the model's names of its parameters (optimizer_state's).
StateByName = dict[str, dict[str, torch.Tensor]]


class OptimizerLike(Protocol):
    """What a checkpoint reads and fills of an optimizer: torch.optim's, `optim.Functional`
    or `ema.Average` (shaped as one): its groups' parameters and its state by parameter."""

    param_groups: list[TorchState]  # torch's param_group dicts (ours: optim.ParamGroup)
    state: MutableMapping[torch.Tensor, TorchState]  # torch's: a parameter's state by key


def due(spec: CommonSpec, step: int) -> bool:
    """Whether to checkpoint after `step` (1-based): every checkpoint.everySteps steps, and
    always after the last one."""
    if spec.checkpoint is None:
        return False
    return step % spec.checkpoint.every_steps == 0 or step == spec.steps


def latest_for(env: Env) -> Checkpoint | None:
    """The newest complete checkpoint of a job whose spec asks for checkpoints."""
    if env.spec.checkpoint is None:
        return None
    return latest(env.spec.checkpoint.path, lambda message: world.log(env, message))


def fits(found: Checkpoint, env: Env, **expected: Unpack[ManifestFields]) -> None:
    """Refuse a checkpoint of another kind of job or model."""
    wanted: dict[str, object] = {"kind": env.kind, **expected}
    differs = {k: found.manifest.get(k) for k, v in wanted.items() if found.manifest.get(k) != v}
    if differs:
        have = ", ".join(f"{k} {v}" for k, v in differs.items())
        want = ", ".join(f"{k} {wanted[k]}" for k in differs)
        raise CheckpointError(
            f"{found.directory} holds a checkpoint of {have}, not {want}; give this job"
            " another checkpoint.path"
        )


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _step_of(path: Path) -> int | None:
    name = path.name
    if path.is_dir() and name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None


# ---------------------------------------------------------------------------- files


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` so that readers see the old content or the new, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Hashing:
    """A file that hashes and counts what is written to it: torch.save streams a part into
    the file, with no copy of it in memory, and its SHA-256 comes along."""

    def __init__(self) -> None:
        self.digest, self.bytes, self.file = hashlib.sha256(), 0, None

    def over(self, file: BinaryIO) -> _Hashing:
        self.file = file
        return self

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.bytes += view.nbytes
        return self.file.write(view)

    def flush(self) -> None:
        self.file.flush()


def save_part(directory: str | Path, name: str, state: object) -> FileEntry:
    """torch.save `state` as `directory/name`, atomically, straight into the file; its
    manifest entry."""
    written = _Hashing()
    write_atomic(Path(directory) / name, lambda f: torch.save(state, written.over(f)))
    return {"name": name, "bytes": written.bytes, "sha256": written.digest.hexdigest()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_part(
    directory: str | Path, entry: ListedFile, mmap: bool = False, checksum: bool = True
) -> Any:
    """torch.load a part after checking it is exactly what the manifest says (its size, and
    its SHA-256 unless the caller knows it was checked); with `mmap`, its tensors stay in the
    file until they are read."""
    path = Path(directory) / entry["name"]
    problem = _mismatch(path, entry, checksum)
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    return torch.load(path, weights_only=False, mmap=mmap)


def _mismatch(path: Path, entry: ListedFile, checksum: bool = True) -> str | None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != entry["bytes"]:
        return f"{size} bytes, the manifest says {entry['bytes']} (truncated or replaced)"
    if checksum and _sha256(path) != entry["sha256"]:
        return "its SHA-256 differs from the manifest's"
    return None


# ---------------------------------------------------------------------------- manifests


def write_manifest(
    root: str | Path, step: int, files: list[FileEntry], **meta: Unpack[ManifestFields]
) -> Path:
    """Complete the checkpoint of `step`: every file must be there, as its writer said.

    The files were written by other processes; checking their sizes here also catches a
    checkpoint path that is not shared between the job's pods."""
    directory = step_dir(root, step)
    for entry in files:
        problem = _mismatch(directory / entry["name"], entry, checksum=False)
        if problem:
            raise CheckpointError(
                f"checkpoint of step {step}: {entry['name']}: {problem}, as the master sees"
                f" it in {directory}; checkpoint.path must be one directory shared by every"
                f" process of the job (e.g. a ReadWriteMany volume)"
            )
    index: dict[str, str] = {}  # which file holds each module state (save_module's)
    for entry in files:
        for name in entry.get("holds", ()):
            index.setdefault(name, entry["name"])
    listed = [ListedFile(name=e["name"], bytes=e["bytes"], sha256=e["sha256"]) for e in files]
    manifest = Manifest(format=FORMAT, step=step, time=time.time(), files=listed, index=index)
    body = json.dumps({**manifest, **meta}, indent=1).encode()
    write_atomic(directory / MANIFEST, lambda f: f.write(body))
    return directory


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its step, its directory and its manifest as read."""

    step: int
    directory: Path
    manifest: Manifest

    def entry(self, name: str) -> ListedFile:
        for entry in self.manifest["files"]:
            if entry["name"] == name:
                return entry
        raise CheckpointError(f"{self.directory / MANIFEST} lists no file {name}")

    def load(self, name: str) -> Any:
        return load_part(self.directory, self.entry(name))


def verify(directory: Path) -> Checkpoint | str:
    """The checkpoint in `directory`, or why it is not a complete one."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (its writing never finished)"
    except (OSError, ValueError) as e:
        return f"unreadable manifest: {e}"
    if manifest.get("format") != FORMAT or manifest.get("step") != _step_of(directory):
        return "the manifest does not belong to this directory"
    for entry in manifest["files"]:
        problem = _mismatch(directory / entry["name"], entry)
        if problem:
            return f"{entry['name']}: {problem}"
    return Checkpoint(manifest["step"], directory, manifest)


def latest(root: str | Path, log: Callable[[str], None] = lambda _: None) -> Checkpoint | None:
    """The newest complete checkpoint under `root`; `log` hears why newer ones were passed."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = sorted((s, p) for p in root.iterdir() if (s := _step_of(p)) is not None)
    for _, directory in reversed(steps):
        found = verify(directory)
        if isinstance(found, Checkpoint):
            return found
        log(f"checkpoint {directory} is not used: {found}")
    return None


def prune(root: str | Path, keep: int = KEEP) -> None:
    """Keep the `keep` newest complete checkpoints; remove older step directories and
    unfinished ones older than the newest checkpoint."""
    root = Path(root)
    steps = sorted((s, p) for p in root.iterdir() if (s := _step_of(p)) is not None)
    complete = [s for s, p in steps if (p / MANIFEST).exists()]
    if not complete:
        return
    kept = complete[-keep:]
    for step, directory in steps:
        if step < kept[0] or (step < kept[-1] and step not in kept):
            shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------------------- state


def rng_state() -> RngState:
    state = RngState(torch=torch.get_rng_state(), python=random.getstate())
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: RngState) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def optimizer_state(optim: OptimizerLike, module: nn.Module, copy: bool = True) -> StateByName:
    """The state of a torch.optim optimizer (or an `optim.Functional` one) by name of
    `module`'s parameters, on the CPU: a copy, or (`copy` False, for a caller that writes it
    at once) the live tensors where they are on the CPU already."""
    names = {id(p): n for n, p in module.named_parameters()}
    params = [p for group in optim.param_groups for p in group["params"]]
    return {
        names[id(p)]: {k: _to(v, torch.device("cpu"), copy) for k, v in optim.state[p].items()}
        for p in params
        if p in optim.state and optim.state[p]
    }


def load_optimizer_state(optim: OptimizerLike, module: nn.Module, saved: StateByName) -> None:
    """Give a fresh optimizer the state `optimizer_state` saved."""
    params = dict(module.named_parameters())
    unknown = sorted(set(saved) - set(params))
    if unknown:
        raise CheckpointError(f"optimizer state for parameters this model lacks: {unknown[:5]}")
    # As torch.optim's load_state_dict does: "step" counters stay on the CPU.
    optim.state.update(
        {
            params[n]: {
                k: _to(v, torch.device("cpu") if k == "step" else params[n].device, copy=True)
                for k, v in s.items()
            }
            for n, s in saved.items()
        }
    )


def _to(value: object, device: torch.device, copy: bool = False) -> object:
    """A tensor on `device` (a copy if asked); other values as they are."""
    return value.detach().to(device, copy=copy) if isinstance(value, torch.Tensor) else value


def save_module(
    directory: str | Path,
    name: str,
    module: nn.Module,
    optimizers: Mapping[str, OptimizerLike],
    **extra: object,
) -> FileEntry:
    """Save a module's weights and buffers under its own names, its optimizers' state
    (keyed, e.g. by the trainer that created each) and this process's RNG state; the
    manifest entry, which says the names the file holds (write_manifest indexes them)."""
    model = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    state = {
        "model": model,
        "optimizers": {
            key: optimizer_state(o, module, copy=False)  # written at once
            for key, o in optimizers.items()
        },
        "rng": rng_state(),
        **extra,
    }
    entry = save_part(directory, name, state)
    entry["holds"] = list(model)
    return entry
