"""A trained model out: state dicts written as files a plain process loads, and a JSON
beside them saying what they are. One path for a live run's `spec.output` and for
`pipejob export` from a checkpoint, for both kinds.

safetensors by default (no pickle: safe to load from anywhere), torch's own format on
request. Tensors go out as contiguous CPU copies: safetensors refuses views and shared
storage, and a tied weight is then written under each of its names, as `load_state_dict`
(strict) expects."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

SUFFIX = {"safetensors": ".safetensors", "torch": ".pt"}
INFO = "model.json"


def write(directory: str | Path, files: dict[str, dict[str, torch.Tensor]],
          info: dict[str, Any], format: str = "safetensors") -> list[Path]:  # fmt: skip
    """Each state dict of `files` as <name><suffix> in `directory`, and model.json with
    `info` and the files' names; the paths written (the JSON last)."""
    if format not in SUFFIX:
        raise ValueError(f"unknown output format {format!r}: one of {', '.join(SUFFIX)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, state in files.items():
        tensors = {k: v.detach().cpu().clone().contiguous() for k, v in state.items()}
        path = directory / f"{name}{SUFFIX[format]}"
        partial = path.with_name(path.name + ".partial")  # never a half-written model
        if format == "safetensors":
            from safetensors.torch import save_file

            save_file(tensors, str(partial), metadata={"format": "pt"})
        else:
            torch.save(tensors, partial)
        os.replace(partial, path)
        written.append(path)
    meta = {
        **info,
        "format": format,
        "files": {name: p.name for name, p in zip(files, written, strict=True)},
    }
    (directory / INFO).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return [*written, directory / INFO]
