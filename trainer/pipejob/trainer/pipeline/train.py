"""The PipelineJob master: builds and cuts the model, places the shards on the stages, runs
the steps, checkpoints and resumes, and returns the run's summary."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed.rpc as rpc

from pipejob.core.kinds.pipeline import AUTO
from pipejob.trainer import workloads
from pipejob.trainer.pipeline.schedule import Replicas, StepResult
from pipejob.trainer.pipeline.shards import (
    Partition,
    Shards,
    build_shards,
    candidate_table,
    describe,
    share,
    stage_resources,
)
from pipejob.trainer.pipeline.stage import on_stage
from pipejob.trainer.pipeline.summary import render, stage_report, summarize
from pipejob.trainer.runtime import (
    checkpoint,
    master,
    monitor,
    profiling,
    world,
)
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads.synthetic import SyntheticImages


def train(env: Env) -> dict[str, Any]:
    spec = env.spec
    steps, size = spec.steps, spec.image_size
    board = monitor.board()
    # Replica r's stages, in order: every replica holds the same shards.
    every = env.names("stage")
    replicas = [every[r * spec.stages : (r + 1) * spec.stages] for r in range(spec.replicas)]
    names = replicas[0]
    found = checkpoint.latest_for(env)
    if found is None:
        threads, hosts = stage_resources(env, spec.stages)
        shared = "; ".join(f"{', '.join(names[k] for k in h.stages)} share {h.cpus:g} CPU(s)"
                           for h in hosts if len(h.stages) > 1)  # fmt: skip
        world.log(env, f"{spec.model}: measuring layer costs at {size}x{size} with"
                       f" {threads} intra-op thread(s), as the stages compute"
                       + (f" ({shared})" if shared else ""))  # fmt: skip
        if spec.gpus_per_stage > 0:
            hosts = []  # the stages compute on their GPUs, not on the cores they share
        shards = build_shards(spec, None, threads, hosts, lambda message: world.log(env, message))
    else:
        shards = build_shards(spec, saved_partition(env, found))
    m, candidates = shards.partition.micro_batches, shards.partition.candidates
    if spec.micro_batches == AUTO:
        how = "chose" if found is None else "resumes with the checkpoint's"
        table = ":\n" + candidate_table(candidates, m) if candidates else ""
        world.log(env, f"microBatches auto {how} {m} (micro-batches of"
                       f" {spec.batch_size // m}){table}")  # fmt: skip
    for i in range(spec.stages):
        layers = [n for n, _ in shards.of(i)]
        world.log(env, f"stage {i}: {describe(layers)}, {share(shards, i):.0%} of measured cost")
    if spec.replicas > 1:
        world.log(env, f"{spec.replicas} replicas of the pipeline, {spec.batch_size} samples each"
                       " per step; stage i of every replica averages its gradients")  # fmt: skip
    device = "cuda:0" if spec.gpus_per_stage > 0 else "cpu"
    pipelines = Replicas(replicas, shards, spec, device)
    data, loss = workloads.pipeline_data(spec), workloads.loss(spec)
    first = 0 if found is None else resume(env, found, pipelines, data, shards)
    profile = profiling.settings(spec)
    results: list[StepResult] = []
    started = time.perf_counter()
    board.phase("training")
    samples = spec.batch_size * spec.replicas  # per step
    for step in range(first, steps):
        images, labels = data.batch()
        with profiling.window(env, profile, step + 1, every) as rpc_calls, rpc_calls():
            result = pipelines.step(images, labels, m, step, loss)
        results.append(result)
        seconds = result.pipeline_seconds + result.optimizer_seconds
        board.step(step + 1, result.loss, seconds, samples)
        if checkpoint.due(spec, step + 1):
            save_checkpoint(env, step + 1, pipelines, data, shards)
        if (step + 1) % spec.log_every == 0 or step + 1 == steps:
            rate = samples / seconds
            world.log(env, f"step {step + 1}/{steps}  loss {result.loss:.4f}  {rate:.1f} samples/s")
            board.stages(*stage_report(names, pipelines.timings(), step, result))
    if not results:
        return master.nothing_left(env, first)
    summary = summarize(env, names, shards, results, pipelines.timings(), first)
    summary["replicaDivergence"] = pipelines.divergence()
    summary["wallSeconds"] = round(time.perf_counter() - started, 3)
    world.log(env, "summary:\n" + render(summary))
    return summary


# ---------------------------------------------------------------------------- checkpoints


def save_checkpoint(env: Env, step: int, pipelines: Replicas, data: SyntheticImages,
                    shards: Shards) -> None:  # fmt: skip
    """Each stage of replica 0 saves its shard and its optimizer's state (the replicas are
    identical: one copy of each stage, `stage<i>.pt`), the master its RNG states and the
    partition; the master's manifest, written last, makes the step count."""
    pipeline = pipelines.pipelines[0]
    root = env.spec.checkpoint.path
    directory = str(checkpoint.step_dir(root, step))
    start = time.perf_counter()
    local = checkpoint.local_optimizers(pipelines.optimizers[0])
    saving = [
        rpc.rpc_async(
            name, on_stage, args=(stage, "save", local.get(name), directory, f"stage{i}.pt")
        )  # fmt: skip
        for i, (name, stage) in enumerate(zip(pipeline.names, pipeline.stages, strict=True))
    ]
    own = {"rng": checkpoint.rng_state(), "data": data.generator.get_state()}
    files = [checkpoint.save_part(directory, "master.pt", own), *torch.futures.wait_all(saving)]
    checkpoint.write_manifest(
        root, step, files, kind=env.kind, job=env.job, model=env.spec.model,
        stageCount=len(shards.ranges),
        stages=[[n for n, _ in shards.of(i)] for i in range(len(shards.ranges))],
        ranges=[[r.start, r.stop] for r in shards.ranges], costs=shards.costs,
        microBatches=shards.partition.micro_batches,
        microBatchCandidates=shards.partition.candidates,
    )  # fmt: skip
    checkpoint.prune(root)
    master.checkpoint_written(env, step, files, time.perf_counter() - start, directory)


def saved_partition(env: Env, found: checkpoint.Checkpoint) -> Partition:
    """The checkpoint's split of the layers and micro-batch count: its shards fit no other
    split, and the run continues with the count it was trained with (`auto` takes the
    checkpoint's; another explicit count is refused)."""
    requested, manifest = env.spec.micro_batches, found.manifest
    recorded = manifest.get("microBatches")  # None: written before the count was kept
    if requested == AUTO and recorded is None:
        raise checkpoint.CheckpointError(
            f"{found.directory} does not record its micro-batch count, which microBatches"
            " auto would reuse; set spec.microBatches to the count it was trained with"
        )
    same = {} if requested == AUTO or recorded is None else {"microBatches": requested}
    checkpoint.fits(found, env, model=env.spec.model, stageCount=env.spec.stages, **same)
    return Partition([range(a, b) for a, b in manifest["ranges"]], manifest["costs"],
                     recorded or requested, manifest.get("microBatchCandidates", []))  # fmt: skip


def resume(
    env: Env,
    found: checkpoint.Checkpoint,
    pipelines: Replicas,
    data: SyntheticImages,
    shards: Shards,
) -> int:
    """Load every stage's shard and optimizer state (stage i of every replica from the one
    copy of stage i) and the master's RNG states; the step the checkpoint was taken
    after."""
    layers = [[n for n, _ in shards.of(i)] for i in range(len(shards.ranges))]
    if layers != found.manifest["stages"]:
        raise checkpoint.CheckpointError(
            f"{found.directory} was written for other layers than {env.spec.model}'s;"
            " give this job another checkpoint.path"
        )
    directory = str(found.directory)
    loading = []
    for pipeline, optimizer in zip(pipelines.pipelines, pipelines.optimizers, strict=True):
        local = checkpoint.local_optimizers(optimizer)
        for i, (name, stage) in enumerate(zip(pipeline.names, pipeline.stages, strict=True)):
            args = (stage, "load", local.get(name), directory, found.entry(f"stage{i}.pt"))
            loading.append(rpc.rpc_async(name, on_stage, args=args))
    own = found.load("master.pt")
    checkpoint.set_rng_state(own["rng"])
    data.generator.set_state(own["data"])
    torch.futures.wait_all(loading)
    world.log(env, f"resumed from step {found.step} ({found.directory})")
    monitor.board().resumed(found.step)
    return found.step
