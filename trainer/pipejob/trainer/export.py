"""`pipejob export CHECKPOINT_DIR OUT`: the trained model out of a complete checkpoint, as
the files a finished run's `spec.output` writes (runtime/output.py), for either kind.
CHECKPOINT_DIR is a job's checkpoint.path (its newest complete checkpoint is taken) or one
step's directory in it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from pipejob.trainer.runtime import checkpoint, output


def find(path: str | Path) -> checkpoint.Checkpoint:
    """The complete checkpoint at `path`: a step directory, or the newest under a root."""
    path = Path(path)
    if (path / checkpoint.MANIFEST).exists():
        found = checkpoint.verify(path)
        if isinstance(found, str):
            raise checkpoint.CheckpointError(f"{path} is not a complete checkpoint: {found}")
        return found
    latest = checkpoint.latest(path, lambda message: print(f"pipejob: {message}", file=sys.stderr))
    if latest is None:
        raise checkpoint.CheckpointError(f"{path} holds no complete checkpoint")
    return latest


def pipeline_model(found: checkpoint.Checkpoint) -> dict[str, torch.Tensor]:
    """Every stage's state and the state no stage holds: the whole model, by its names."""
    state: dict[str, torch.Tensor] = dict(found.load("master.pt").get("rest", {}))
    for i in range(found.manifest["stageCount"]):
        state.update(found.load(f"stage{i}.pt")["model"])
    return state


def export(path: str | Path, out: str | Path, format: str = "safetensors") -> list[Path]:
    """Write the checkpoint's model into directory `out`; the paths written."""
    found = find(path)
    manifest = found.manifest
    kind = manifest.get("kind")
    if kind == "PipelineJob":
        if "info" not in manifest:
            raise checkpoint.CheckpointError(
                f"{found.directory} was written before checkpoints kept the model's names;"
                " it cannot be exported"
            )
        info: dict[str, Any] = {**manifest["info"], "steps": found.step,
                                "checkpoint": str(found.directory)}  # fmt: skip
        return output.write(out, {"model": pipeline_model(found)}, info, format)
    if kind == "HybridJob":
        from pipejob.trainer.hybrid.output import export_checkpoint

        return export_checkpoint(found.directory, manifest, out, format)
    raise checkpoint.CheckpointError(f"{found.directory}: unknown job kind {kind!r}")


def main(checkpoint_dir: str, out: str, format: str = "safetensors") -> int:
    try:
        written = export(checkpoint_dir, out, format)
    except (checkpoint.CheckpointError, OSError, ValueError) as e:
        print(f"pipejob: export: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0
