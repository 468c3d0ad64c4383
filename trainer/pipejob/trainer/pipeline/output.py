"""A PipelineJob's trained model as one file anyone can load: what spec.output writes at the
end of a run, and what `pipejob export` writes from a complete checkpoint (the files are
written by runtime/output.py, the writer both kinds share):

- `model.safetensors` (`model.pt` with format torch): every stage's parameters and buffers,
  and those no stage holds, under the model's own names: a fresh model from the user's
  factory loads it with `load_state_dict(strict=True)`;
- `model.json`: the kind, the model spec, the held-out evaluation and the step count;
- `config.json` for a Hugging Face model (a PreTrainedModel): its config, so that its class's
  `from_pretrained(path)` loads the folder as well."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.runtime import checkpoint, output
from pipejob.trainer.workloads import models


def info(kind: str, job: str, spec: PipelineSpec, steps: int,
         evaluation: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """What model.json says of the model file (a checkpoint's manifest keeps it too)."""
    return {"kind": kind, "job": job, "model": models.as_spec(spec.model),
            "numClasses": spec.num_classes, "imageSize": spec.image_size, "steps": steps,
            "evaluation": evaluation}  # fmt: skip


def write(out: str | Path, format: str, stages: list[dict[str, torch.Tensor]],
          rest: dict[str, torch.Tensor], about: dict[str, Any],
          config: dict[str, Any] | None = None) -> list[Path]:  # fmt: skip
    """The stages' states and the rest as one model file in `out`, and model.json (and a
    Hugging Face model's `config`, as config.json)."""
    state = dict(rest)
    for part in stages:
        state.update(part)
    written = output.write(out, {"model": state}, about, format)
    if config is not None:
        path = Path(out) / "config.json"
        path.write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        written.append(path)
    return written


def export_checkpoint(directory: str | Path, manifest: dict[str, Any], out: str | Path,
                      format: str = "safetensors") -> list[Path]:  # fmt: skip
    """The model of a complete PipelineJob checkpoint (`pipejob export`)."""
    found = checkpoint.Checkpoint(manifest["step"], Path(directory), manifest)
    if "info" not in manifest:
        raise checkpoint.CheckpointError(
            f"{directory} was written before checkpoints kept the model's names;"
            " it cannot be exported"
        )
    stages = [found.load(f"stage{i}.pt")["model"] for i in range(manifest["stageCount"])]
    own = found.load("master.pt")
    about = {**manifest["info"], "steps": found.step, "checkpoint": str(found.directory)}
    return write(out, format, stages, own.get("rest", {}), about, own.get("config"))
