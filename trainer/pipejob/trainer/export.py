"""`pipejob export CHECKPOINT_DIR OUT`: the trained model out of a complete checkpoint, as
the files a finished run's `spec.output` writes (runtime/model_files.py), for either kind.
CHECKPOINT_DIR is a job's checkpoint.path (its newest complete checkpoint is taken) or one
step's directory in it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from pipejob.core.kinds import KINDS
from pipejob.trainer.runtime import checkpoint


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


def export(path: str | Path, out: str | Path, format: str = "safetensors") -> list[Path]:
    """Write the checkpoint's model into directory `out`, as its kind's trainer does at the
    end of a run; the paths written."""
    found = find(path)
    kind = KINDS.get(found.manifest.get("kind", ""))
    if kind is None:
        raise checkpoint.CheckpointError(
            f"{found.directory}: unknown job kind {found.manifest.get('kind')!r}"
        )
    trainer = importlib.import_module(kind.trainer)
    return trainer.export_checkpoint(found.directory, found.manifest, out, format)


def main(checkpoint_dir: str, out: str, format: str = "safetensors") -> int:
    try:
        written = export(checkpoint_dir, out, format)
    except (checkpoint.CheckpointError, OSError, ValueError) as e:
        print(f"pipejob: export: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0
