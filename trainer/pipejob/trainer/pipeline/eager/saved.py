"""Checkpoints on the eager path: each stage saves its modules and its optimizer's state
under the model's own names (`stage<i>.pt`, replica 0's: the replicas are identical), the
master the glue's with its RNG and the data's position (`master.pt`), indexed by name in the
manifest as the traced path's are; a run resumes from any checkpoint of the model, whichever
path, cut and replica count wrote it, each process (every replica's) loading its own names
from whichever files hold them."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline import trained_model
from pipejob.trainer.pipeline.eager import remote
from pipejob.trainer.runtime import checkpoint, monitor, roles, state_by_name, world
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads import data, models

if TYPE_CHECKING:  # run.py imports this module
    from pipejob.trainer.pipeline.eager.run import EagerState


def save(env: Env[PipelineSpec], step: int, t: EagerState, feed: data.Feed) -> None:
    """The checkpoint after `step` (1-based) of what the master trains with (`t`): the
    master's file keeps the glue's weights, what `t.kept` holds, the data's position and
    fp16's loss scale."""
    spec = env.spec
    assert spec.checkpoint is not None
    root = spec.checkpoint.path
    directory = str(checkpoint.step_dir(root, step))
    start = time.perf_counter()
    stages, placement = t.stages, t.placement.stages
    saving = [
        stages.call_async(i, remote.save, directory, f"stage{i}.pt")
        for i in range(len(stages.held[0]))  # replica 0's: the replicas are identical
    ]
    extra = {} if t.scale is None else {"lossScale": t.scale.state()}
    own = checkpoint.save_module(
        directory, "master.pt", t.model, t.kept(), data=feed.state(), **extra
    )
    files = [own, *torch.futures.wait_all(saving)]
    checkpoint.write_manifest(
        root,
        step,
        files,
        kind=env.kind,
        job=env.job,
        model=models.as_spec(spec.model),
        stageCount=len(stages.held[0]),
        engine=spec.engine,
        path="eager",
        placement=placement,
        info=trained_model.info(env.kind, env.job, spec, step, None),
    )
    checkpoint.prune(root)
    roles.checkpoint_written(env, step, files, time.perf_counter() - start, directory)


def resume(
    env: Env[PipelineSpec], found: checkpoint.Checkpoint, t: EagerState, feed: data.Feed
) -> int:
    """Every process's state by name from the checkpoint `found`, into what the master
    trains with (`t`: fp16's loss scale too, where the checkpoint keeps one) and the data's
    position; the step it was taken after."""
    model, kept, stages, scale = t.model, t.kept(), t.stages, t.scale
    checkpoint.fits(found, env, model=models.as_spec(env.spec.model))
    index = state_by_name.index_of(found)
    directory = str(found.directory)
    loading = []
    # Every replica's stage i holds the same names: asked of replica 0's, loaded by each.
    for i, names in enumerate(stages.on_each(remote.state_names)):
        sources = state_by_name.sources(found, index, names)
        for r in range(len(stages.held)):
            loading.append(stages.call_async(i, remote.load, directory, sources, replica=r))
    mine = state_by_name.sources(found, index, list(model.state_dict()))
    state_by_name.load_named(directory, mine, model, kept)
    own = found.load("master.pt")
    checkpoint.set_rng_state(own["rng"])
    feed.load_state(own["data"])
    if scale is not None and "lossScale" in own:
        scale.load(own["lossScale"])
    torch.futures.wait_all(loading)
    world.log(env, f"resumed from step {found.step} ({found.directory})")
    monitor.board().resumed(found.step)
    return found.step
