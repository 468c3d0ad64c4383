"""A PipelineJob's trained model as files anyone can load, the same whether a run writes them
at its end (spec.output) or `pipejob export` from a complete checkpoint: one file gathered
by the master up to `SINGLE_FILE_BYTES`, else one shard per stage and an index (Hugging Face's
layout), with model.json and a Hugging Face model's config.json. The files and how to load
them: the user guide's "The loss, the evaluation and the output"; the writer both kinds
share: runtime/model_files.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.rpc as rpc

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline.run_json import PipelineModelInfo
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.pipeline.stage_calls import StageRef, remote_stage
from pipejob.trainer.runtime import checkpoint, model_files
from pipejob.trainer.runtime.checkpoint_format import Manifest
from pipejob.trainer.runtime.json_values import JsonObject
from pipejob.trainer.runtime.model_files import ShardWritten
from pipejob.trainer.workloads import models
from pipejob.trainer.workloads.metrics import HeldOutEvaluation

# Up to this many bytes of parameters and buffers the master gathers the model and writes
# one file, which every tool (and safetensors' `load_file`) reads as it is. Above it,
# gathering would put the whole model in the master, which otherwise holds none of it, so
# each stage writes its own shard. 256 MiB is 64M float32 parameters: smaller than the models
# pipelines are for, and small beside what any process that trains holds.
SINGLE_FILE_BYTES = 256 * 2**20


def info(
    kind: str, job: str, spec: PipelineSpec, steps: int, evaluation: HeldOutEvaluation | None
) -> PipelineModelInfo:
    """What model.json says of the model file (a checkpoint's manifest keeps it too)."""
    return {
        "kind": kind,
        "job": job,
        "model": models.as_spec(spec.model),
        "numClasses": spec.num_classes,
        "imageSize": spec.image_size,
        "steps": steps,
        "evaluation": evaluation,
    }


def write(
    out: str | Path,
    format: str,
    stages: list[dict[str, torch.Tensor]],
    rest: dict[str, torch.Tensor],
    about: PipelineModelInfo,
    config: JsonObject | None = None,
    metadata: model_files.Metadata | None = None,
) -> list[Path]:
    """The stages' states and the rest as one model file in `out` (with the modules'
    `metadata`), and model.json (and a Hugging Face model's `config`, as config.json)."""
    state = dict(rest)
    for part in stages:
        state.update(part)
    return [
        *model_files.write(out, {"model": state}, about, format, metadata),
        *write_config(out, config),
    ]


def write_live(
    out: str | Path,
    format: str,
    stages: list[StageRef],
    rest: dict[str, torch.Tensor],
    about: PipelineModelInfo,
    config: JsonObject | None = None,
    single_file_bytes: int | None = None,
    metadata: model_files.Metadata | None = None,
) -> list[Path]:
    """The model a run's stages hold (`stages`)
    and `rest`, the state no stage holds, written into `out`: one file when it is at most
    `single_file_bytes` (SINGLE_FILE_BYTES), else each stage writing its own shard, all at
    once, and the master the rest's and the index (which holds the modules' `metadata`).
    The paths written."""
    model_files.check_format(format)
    limit = SINGLE_FILE_BYTES if single_file_bytes is None else single_file_bytes
    held = torch.futures.wait_all([rpc.rpc_async(s.name, held_bytes, args=(s,)) for s in stages])
    if sum(held) + model_files.state_bytes(rest) <= limit:
        states = torch.futures.wait_all([remote_stage(s).future(StageBase.state) for s in stages])
        return write(out, format, states, rest, about, config, metadata)
    files = shard_files(len(stages), bool(rest), format)
    writing = [
        remote_stage(s).future(StageBase.write_shard, str(out), f, format)
        for s, f in zip(stages, files, strict=False)
    ]
    mine = [model_files.write_shard(out, files[-1], rest, format)] if rest else []
    return finish(out, format, [*torch.futures.wait_all(writing), *mine], about, config, metadata)


def held_bytes(stage: StageRef) -> int:
    """Runs on a stage's worker: the bytes of its shard's state, as a file holds them."""
    return model_files.state_bytes(stage.local_value().layers.state_dict())


def shard_files(stages: int, rest: bool, format: str) -> list[str]:
    """The shards' names: one per stage, and one more for the rest when there is some."""
    count = stages + int(rest)
    return [model_files.shard_name(k + 1, count, format) for k in range(count)]


def finish(
    out: str | Path,
    format: str,
    shards: list[ShardWritten],
    about: PipelineModelInfo,
    config: JsonObject | None,
    metadata: model_files.Metadata | None = None,
) -> list[Path]:
    """After the shards: the index, model.json and config.json. A shard the master cannot
    see as its writer wrote it means the stages wrote into directories of their own."""
    out = Path(out)
    for shard in shards:
        path = out / shard["file"]
        size = path.stat().st_size if path.exists() else None
        if size != shard["bytes"]:
            raise ValueError(  # a configuration error: a restart would only repeat it
                f"spec.output.path: {path} is {'missing' if size is None else f'{size} bytes'}"
                f" where its writer wrote {shard['bytes']} bytes; every stage writes its shard"
                " of a model this big, so the path must be one directory shared by every"
                " process of the job (e.g. a ReadWriteMany volume)"
            )
    return [
        *model_files.write_index(out, shards, about, format, metadata=metadata),
        *write_config(out, config),
    ]


def write_config(out: str | Path, config: JsonObject | None) -> list[Path]:
    """A Hugging Face model's config.json beside its model file (none for another model)."""
    if config is None:
        return []
    path = Path(out) / "config.json"
    path.write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    return [path]


def export_checkpoint(
    directory: str | Path,
    manifest: Manifest,
    out: str | Path,
    format: str = "safetensors",
    single_file_bytes: int | None = None,
) -> list[Path]:
    """The model of a complete PipelineJob checkpoint (`pipejob export`): the files a run
    writes. A model over the limit is written one stage's checkpoint file at a time, so
    the export never holds more than one stage's."""
    found = checkpoint.Checkpoint(manifest["step"], Path(directory), manifest)
    if "info" not in manifest:
        raise checkpoint.CheckpointError(
            f"{directory} was written before checkpoints kept the model's names;"
            " it cannot be exported"
        )
    model_files.check_format(format)
    limit = SINGLE_FILE_BYTES if single_file_bytes is None else single_file_bytes
    parts = [f"stage{i}.pt" for i in range(manifest["stageCount"])]
    own = found.load("master.pt")
    # A checkpoint of an older pipejob keeps no module metadata: written without it.
    rest, config, metadata = own.get("rest", {}), own.get("config"), own.get("metadata")
    about = {**manifest["info"], "steps": found.step, "checkpoint": str(found.directory)}
    if sum(_model_bytes(found, part) for part in parts) + model_files.state_bytes(rest) <= limit:
        stages = [found.load(part)["model"] for part in parts]
        return write(out, format, stages, rest, about, config, metadata)
    files = shard_files(len(parts), bool(rest), format)
    shards = []
    for part, file in zip(parts, files, strict=False):  # one stage's file in memory at a time
        shards.append(model_files.write_shard(out, file, found.load(part)["model"], format))
    if rest:
        shards.append(model_files.write_shard(out, files[-1], rest, format))
    return finish(out, format, shards, about, config, metadata)


def _model_bytes(found: checkpoint.Checkpoint, part: str) -> int:
    """The bytes of a stage's model state in its checkpoint file, from the file mapped, not
    read: its tensors' sizes without their data."""
    found.entry(part)  # listed in the manifest
    state = torch.load(found.directory / part, mmap=True, weights_only=False)
    return model_files.state_bytes(state["model"])
