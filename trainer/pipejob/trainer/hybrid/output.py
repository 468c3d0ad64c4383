"""A HybridJob's trained model as files anyone can load: what spec.output writes at the end
of a run, and what `pipejob export` writes from a complete checkpoint. Both go through
`write`, so the two give the same files:

- `table.safetensors` (`table.pt` with format torch): the EmbeddingBag's state_dict, key
  `weight`: `nn.EmbeddingBag(numEmbeddings, dim, mode=mode).load_state_dict(..., strict=True)`;
- `dense.safetensors` (`dense.pt`): the dense module's state_dict under its own names, which
  a fresh module from the user's factory (or `nn.Linear(dim, outFeatures)`) loads strictly;
- `model.json`: the kind, the model spec (the embedding and dense sections), the final
  metrics (with the held-out evaluation), the step count and the files.

The files are written by runtime/output.py, the writer both kinds share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.trainer.runtime import checkpoint
from pipejob.trainer.runtime import output as written

# Summary fields that describe the trained model (model.json's "metrics").
METRICS = ("firstLoss", "finalLoss", "evalLoss", "evalAccuracy", "evalBags", "evalStep")


def model_spec(spec: HybridSpec) -> dict[str, Any]:
    """The spec's model sections, as in the manifest: what a reader needs to rebuild it."""
    emb, dense = spec.embedding, spec.dense
    section: dict[str, Any] = {"outFeatures": dense.out_features}
    if dense.import_ is not None:
        section |= {"import": dense.import_, "args": dense.args}
    return {"embedding": {"numEmbeddings": emb.num_embeddings, "dim": emb.dim,
                          "mode": emb.mode}, "dense": section}  # fmt: skip


def metrics(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary[k] for k in METRICS if summary.get(k) is not None}


def write(out: str | Path, format: str, table: dict[str, torch.Tensor],
          dense: dict[str, torch.Tensor], meta: dict[str, Any]) -> list[Path]:  # fmt: skip
    """Write the table's and the dense module's state_dicts and model.json (`meta` plus the
    format and the file names) into the directory `out`; the paths written."""
    return written.write(out, {"table": table, "dense": dense}, meta, format)


def export_checkpoint(directory: str | Path, manifest: dict[str, Any], out: str | Path,
                      format: str = "safetensors") -> list[Path]:  # fmt: skip
    """The output files from a complete HybridJob checkpoint: `directory` is its step
    directory and `manifest` its manifest.json (as read); the table comes from ps.pt, the
    dense module from dense.pt (each checked against the manifest). Returns the paths."""
    entries = {e["name"]: e for e in manifest["files"]}
    missing = [n for n in ("ps.pt", "dense.pt") if n not in entries]
    if missing:
        raise checkpoint.CheckpointError(f"{directory}: the manifest lists no {', '.join(missing)};"
                                         " not a complete HybridJob checkpoint")  # fmt: skip
    table = checkpoint.load_part(directory, entries["ps.pt"])["model"]
    dense = checkpoint.load_part(directory, entries["dense.pt"])["model"]
    rows, dim = table["weight"].shape
    model = manifest.get("model") or {"embedding": {"numEmbeddings": rows, "dim": dim}}
    meta = {"kind": manifest.get("kind"), "job": manifest.get("job"), "model": model,
            "metrics": manifest.get("metrics", {}), "steps": manifest["step"],
            "checkpoint": str(directory)}  # fmt: skip
    return write(out, format, table, dense, meta)
