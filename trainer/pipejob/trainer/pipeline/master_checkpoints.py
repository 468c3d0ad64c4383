"""The PipelineJob master's checkpoints: each stage's file under the model's own names, the
master's own state and the manifest (`save_checkpoint`), and a run resumed from any of the
model's checkpoints, of any cut (`resume`)."""

from __future__ import annotations

import time

import torch

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline import trained_model
from pipejob.trainer.pipeline.cut_model import CutModel
from pipejob.trainer.pipeline.driver import ReplicasBase
from pipejob.trainer.pipeline.reader import Reader
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.pipeline.stage_calls import remote_stage
from pipejob.trainer.runtime import checkpoint, monitor, roles, state_by_name, world
from pipejob.trainer.runtime.checkpoint_format import Manifest
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads import models


def save_checkpoint(
    env: Env[PipelineSpec], step: int, pipelines: ReplicasBase, cut_model: CutModel
) -> None:
    """Each stage of replica 0 saves its shard and its optimizer's state under the model's
    own names (the replicas are identical: one copy of each stage, `stage<i>.pt`), the master
    its RNG states, the data's position (replica 0's first stage's) and the partition; the
    master's manifest, written last, says which file holds each name and makes the step
    count."""
    pipeline = pipelines.pipelines[0]
    root = env.spec.checkpoint.path
    directory = str(checkpoint.step_dir(root, step))
    start = time.perf_counter()
    saving = [
        remote_stage(stage).future(StageBase.save, directory, f"stage{i}.pt")
        for i, stage in enumerate(pipeline.stages)
    ]
    own = {
        "rng": checkpoint.rng_state(),
        "data": pipelines.data_state(),
        "rest": cut_model.rest,
        "config": cut_model.config,
        "metadata": cut_model.metadata,
    }
    if pipelines.loss_scale is not None:
        own["lossScale"] = pipelines.loss_scale.state()
    files = [checkpoint.save_part(directory, "master.pt", own), *torch.futures.wait_all(saving)]
    checkpoint.write_manifest(
        root,
        step,
        files,
        kind=env.kind,
        job=env.job,
        model=models.as_spec(env.spec.model),
        stageCount=len(pipeline.stages),  # files stage0.pt, stage1.pt, ...: one per process
        stages=cut_model.units_by_piece(),  # per piece of the cut
        engine=env.spec.engine,
        schedule=env.spec.schedule,
        stagesPerProcess=env.spec.stages_per_process,
        info=trained_model.info(env.kind, env.job, env.spec, step, None),
        ranges=[[r.start, r.stop] for r in cut_model.ranges],
        costs=cut_model.costs,
        microBatches=cut_model.partition.micro_batches,
        microBatchCandidates=cut_model.partition.candidates,
        replicas=len(pipelines.pipelines),
    )
    checkpoint.prune(root)
    roles.checkpoint_written(env, step, files, time.perf_counter() - start, directory)


def resume(
    env: Env[PipelineSpec],
    found: checkpoint.Checkpoint,
    pipelines: ReplicasBase,
    cut_model: CutModel,
) -> int:
    """Load every stage's shard and optimizer state by the model's own names, from the files
    of the checkpoint that hold them (stage i of every replica the same: the checkpoint holds
    one copy, whatever the replica count that wrote it), the master's RNG states and the
    data's position (every replica's first stage's); the step the checkpoint was taken after.
    Either engine resumes the other's checkpoint. A stage process holding exactly the pieces
    a saved one held continues its RNG state; another gets a seed of its own from (seed,
    step, stage)."""
    index = state_by_name.index_of(found)
    manifest = found.manifest
    same = (
        cut_model.units_by_piece() == manifest.get("stages")
        and manifest.get("stagesPerProcess", 1) == env.spec.stages_per_process
    )
    directory = str(found.directory)
    per_stage = []
    for k in range(env.spec.stages):
        names = [
            n for piece in cut_model.process_pieces(k) for n in cut_model.stages[piece].state_dict()
        ]
        entries = state_by_name.sources(found, index, list(dict.fromkeys(names)))
        seed = None if same else env.spec.seed + 1_000_003 * found.step + k
        per_stage.append((entries, seed))
    loading = []
    for pipeline in pipelines.pipelines:
        for stage, (entries, seed) in zip(pipeline.stages, per_stage, strict=True):
            loading.append(remote_stage(stage).future(StageBase.load, directory, entries, seed))
    own = found.load("master.pt")
    checkpoint.set_rng_state(own["rng"])
    if pipelines.loss_scale is not None and "lossScale" in own:
        pipelines.loss_scale.load(own["lossScale"])
    torch.futures.wait_all(loading)
    pipelines.readers(Reader.load_state, own["data"])
    world.log(
        env, f"resumed from step {found.step} ({found.directory})" + _origin(found.manifest, same)
    )
    monitor.board().resumed(found.step)
    return found.step


def _origin(manifest: Manifest, same: bool) -> str:
    """How the checkpoint's world was shaped, when this one is not cut as it was."""
    if same:
        return ""
    return (
        f", written by {manifest.get('stageCount', '?')} stages of the"
        f" {manifest.get('engine', 'rpc')} engine cut at"
        f" {', '.join(s[0] for s in manifest.get('stages', [])[1:]) or '?'}"
    )
