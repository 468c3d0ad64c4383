"""The PipelineJob master, on either engine: plans and cuts the model, has the stages build
their shards, runs the steps through the engine's step driver (driver.py), evaluates,
checkpoints and resumes, writes the model out, and returns the run's summary."""

from __future__ import annotations

import time
from typing import Any

import torch

from pipejob.core.kinds.pipeline import AUTO, PipelineSpec
from pipejob.trainer import workloads
from pipejob.trainer.pipeline import engine, trained_model
from pipejob.trainer.pipeline.balance import shape
from pipejob.trainer.pipeline.driver import Replicas, StepResult
from pipejob.trainer.pipeline.fit import fits_model
from pipejob.trainer.pipeline.reader import Reader
from pipejob.trainer.pipeline.shard import Shard
from pipejob.trainer.pipeline.shards import (
    Partition,
    Shards,
    candidate_table,
    plan_shards,
    share,
    stage_resources,
)
from pipejob.trainer.pipeline.stage_calls import on_stage_async
from pipejob.trainer.pipeline.summary import render, stage_report, summarize
from pipejob.trainer.runtime import (
    adapters,
    checkpoint,
    memory,
    monitor,
    profiling,
    roles,
    world,
)
from pipejob.trainer.runtime.events import Events
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads import data, metrics, models, staged
from pipejob.trainer.workloads.metrics import Tally
from pipejob.trainer.workloads.synthetic import share_of


def train(env: Env) -> dict[str, Any]:
    spec: PipelineSpec = env.spec
    steps = spec.steps
    board = monitor.board()
    # Replica r's stages, in order: every replica holds the same shards. The world runs as
    # many replicas as the plan gave it stages for (an elastic world: any of min..max).
    every = env.names("stage")
    count = len(every) // spec.stages
    replicas = [every[r * spec.stages : (r + 1) * spec.stages] for r in range(count)]
    names = replicas[0]
    title = models.name(spec.model)
    model, numbered = models.build_meta(spec)  # the stages build their own shards
    loss = workloads.loss(spec)
    # The first stage of each replica reads the batches (pipeline/reader.py); here, two
    # samples only, to check that the data fits the model.
    with data.Feed(spec) as feed:
        world.log(env, f"data: {feed.description}")
        inputs, labels = feed.sample(2)
    # A staged model runs as its stages call it (its own forward is not used).
    unchecked = fits_model(
        staged.as_called(spec, model) if spec.model.staged else model, inputs, labels, loss
    )
    if unchecked is not None:
        world.log(env, unchecked)
    found = checkpoint.latest_for(env)
    saved = None if found is None else saved_partition(env, found)
    try:
        if saved is not None:
            shards = plan_shards(spec, model, numbered, names, saved)
            pieces = [shards.piece_units(i) for i in range(len(shards.ranges))]
            if pieces != found.manifest.get("stages"):
                saved = None  # its cut is not this model's: measure anew
        if saved is None:
            threads, hosts = stage_resources(env, spec.stages, spec.gpus_per_stage > 0)
            shared = "; ".join(
                f"{', '.join(names[k] for k in h.stages)} share "
                + ("a GPU" if h.gpu else f"{h.cpus:g} CPU(s)")
                for h in hosts
                if len(h.stages) > 1
            )
            world.log(
                env,
                f"{title}: the stages measure what each part costs on samples of"
                f" shape {shape(inputs[0])}, with their {threads} intra-op"
                " thread(s)" + (f" ({shared})" if shared else ""),
            )
            shards = plan_shards(
                spec, model, numbered, names, None, hosts, lambda message: world.log(env, message)
            )
    except ValueError as e:
        raise ValueError(f"spec.model {title} with {spec.stages} stages: {e}") from None
    m, candidates = shards.partition.micro_batches, shards.partition.candidates
    if spec.micro_batches == AUTO:
        how = "chose" if saved is None else "resumes with the checkpoint's"
        table = ":\n" + candidate_table(candidates, m) if candidates else ""
        world.log(
            env, f"microBatches auto {how} {m} (micro-batches of {spec.batch_size // m}){table}"
        )
    for i in range(spec.stages):
        world.log(env, f"stage {i}: {shards.describe(i)}, {share(shards, i):.0%} of measured cost")
    batch = spec.batch_size * spec.replicas.max  # of every round, at every size
    if count > 1 or spec.replicas.elastic:
        shares = sorted({len(share_of(batch, r, count)) for r in range(count)})
        world.log(
            env,
            f"{count} replica(s) of the pipeline (replicas {spec.replicas.min} to"
            f" {spec.replicas.max}), {' or '.join(map(str, shares))} of each batch's"
            f" {batch} samples each; stage i of every replica averages its"
            " gradients",
        )
    device = "cuda:0" if spec.gpus_per_stage > 0 else "cpu"
    pipelines = engine(spec, "driver").Replicas(replicas, shards, spec, device)
    held = pipelines.pipelines[0].reader(Reader.held_out) if spec.eval is not None else None
    if spec.eval is not None:
        world.log(
            env,
            f"evaluation: {held}"
            if held
            else "evaluation: the data has no held-out set; nothing to evaluate",
        )
    first = 0 if found is None else resume(env, found, pipelines, shards)
    profile = profiling.settings(spec)
    results: list[StepResult] = []
    evaluations: list[dict[str, Any]] = []
    started = time.perf_counter()
    board.phase("training")
    samples = batch * spec.gradient_accumulation  # per step
    events = Events(spec.logging.tensorboard if spec.logging else None, first)
    try:
        for step in range(first, steps):
            with profiling.window(env, profile, step + 1, every) as rpc_calls, rpc_calls():
                result = pipelines.step(m, step, loss)
            results.append(result)
            if result.skipped is not None:  # a non-finite step skipped (spec.skipNonFiniteSteps)
                world.log(env, result.skipped)
            seconds = result.pipeline_seconds + result.optimizer_seconds
            board.step(
                step + 1, result.loss, seconds, samples, lr=result.lr, grad_norm=result.grad_norm
            )
            events.scalars(
                step + 1,
                loss=result.loss,
                lr=result.lr,
                grad_norm=result.grad_norm,
                samples_per_second=samples / seconds,
            )
            if checkpoint.due(spec, step + 1):
                save_checkpoint(env, step + 1, pipelines, shards)
                events.flush()
            if (step + 1) % spec.log_every == 0 or step + 1 == steps:
                rate = samples / seconds
                world.log(
                    env,
                    f"step {step + 1}/{steps}  loss {result.loss:.4f}"
                    f"  {rate:.1f} samples/s  lr {result.lr:.3g}"
                    f"  grad norm {result.grad_norm:.4g}",
                )
                bubble, times = stage_report(names, pipelines.timings(), step, result)
                board.stages(bubble, times)
                memory.refresh(env, board)  # each member's peak, for /progress and /metrics
                events.scalars(step + 1, bubble=bubble)
            if held is not None and evaluation_due(spec, step + 1):
                evaluations.append(evaluate(env, pipelines, m, loss, step + 1))
                figures = evaluations[-1]
                events.scalars(
                    step + 1,
                    eval_loss=figures["loss"],
                    eval_accuracy=figures.get("accuracy"),
                    eval_perplexity=figures.get("perplexity"),
                )
    finally:
        events.close()
    pipelines.readers(Reader.close)
    if spec.output is not None:
        write_output(env, pipelines, shards, evaluations[-1] if evaluations else None)
    if not results:
        return roles.nothing_left(env, first)
    summary = summarize(
        env, names, shards, results, pipelines.timings(), first, pipelines.activation_peaks()
    )
    summary["replicaDivergence"] = pipelines.divergence()
    summary["wallSeconds"] = round(time.perf_counter() - started, 3)
    if evaluations:
        summary["evaluation"] = evaluations[-1]
        summary["evaluations"] = evaluations
    world.log(env, "summary:\n" + render(summary))
    return summary


def evaluation_due(spec: PipelineSpec, step: int) -> bool:
    assert spec.eval is not None
    every = spec.eval.every_steps
    return step == spec.steps or (every > 0 and step % every == 0)


def evaluate(
    env: Env, pipelines: Replicas, micro_batches: int, loss: workloads.Loss, step: int
) -> dict[str, Any]:
    """The held-out figures after `step`, through replica 0 (the replicas are identical)."""
    assert env.spec.eval is not None
    start = time.perf_counter()
    tally = pipelines.evaluate(
        micro_batches, env.spec.eval.batches, loss, Tally(data.task(env.spec))
    )
    figures = {"step": step, **tally.result()}
    metric = "".join(f", {m}" for m in [metrics.describe(figures)] if m)
    world.log(
        env,
        f"eval step {step}: loss {figures['loss']:.4f}{metric} on"
        f" {figures['samples']} held-out samples ({time.perf_counter() - start:.1f}s)",
    )
    monitor.board().evaluated(
        step,
        figures["loss"],
        accuracy=figures.get("accuracy"),
        perplexity=figures.get("perplexity"),
    )
    return figures


def write_output(
    env: Env, pipelines: Replicas, shards: Shards, evaluation: dict[str, Any] | None
) -> None:
    """Every stage's state (replica 0's) and the state no stage holds under the model's own
    names: one file for a small model, else each stage writes its own shard
    (pipeline/trained_model.py); the JSON beside them."""
    spec: PipelineSpec = env.spec
    assert spec.output is not None
    about = trained_model.info(env.kind, env.job, spec, spec.steps, evaluation)
    pipeline = pipelines.pipelines[0]
    paths = trained_model.write_live(
        spec.output.path,
        spec.output.format,
        pipeline.names,
        pipeline.stages,
        shards.rest,
        about,
        shards.config,
        metadata=shards.metadata,
    )
    if shards.adapters:  # a peft model: its adapters as peft writes them, merged on request
        paths += adapters.write(
            spec.output.path, shards.adapters, spec.output.merged, shards.config
        )
    elif spec.output.merged:
        world.log(env, "output.merged: the model has no peft adapters; nothing to merge")
    world.log(env, f"model written: {', '.join(str(p) for p in paths)}")


# ---------------------------------------------------------------------------- checkpoints


def save_checkpoint(env: Env, step: int, pipelines: Replicas, shards: Shards) -> None:
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
        on_stage_async(name, stage, Shard.save, directory, f"stage{i}.pt")
        for i, (name, stage) in enumerate(zip(pipeline.names, pipeline.stages, strict=True))
    ]
    own = {
        "rng": checkpoint.rng_state(),
        "data": pipelines.data_state(),
        "rest": shards.rest,
        "config": shards.config,
        "metadata": shards.metadata,
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
        stages=[shards.piece_units(i) for i in range(len(shards.ranges))],  # per piece of the cut
        engine=env.spec.engine,
        schedule=env.spec.schedule,
        stagesPerProcess=env.spec.stages_per_process,
        info=trained_model.info(env.kind, env.job, env.spec, step, None),
        ranges=[[r.start, r.stop] for r in shards.ranges],
        costs=shards.costs,
        microBatches=shards.partition.micro_batches,
        microBatchCandidates=shards.partition.candidates,
        replicas=len(pipelines.pipelines),
    )
    checkpoint.prune(root)
    roles.checkpoint_written(env, step, files, time.perf_counter() - start, directory)


def saved_partition(env: Env, found: checkpoint.Checkpoint) -> Partition | None:
    """The checkpoint's cut, when this job cuts the model into as many stages (at the same
    split points, if it names them): its measured costs need no new measuring, and each
    stage resumes from its own file. The micro-batch count is the job's, or with `auto` the
    checkpoint's. None: the job is shaped otherwise (or the checkpoint keeps no cut), and
    the stages measure anew; any cut resumes any checkpoint of the model."""
    spec, manifest = env.spec, found.manifest
    checkpoint.fits(found, env, model=models.as_spec(spec.model))
    ranges, stages = manifest.get("ranges"), manifest.get("stages")
    recorded = manifest.get("microBatches")  # None: written before the count was kept
    count = recorded if spec.micro_batches == AUTO else spec.micro_batches
    if ranges is None or len(ranges) != spec.pieces or count is None:
        return None
    if spec.split_points and list(spec.split_points) != [s[0] for s in stages[1:]]:
        return None
    return Partition(
        [range(a, b) for a, b in ranges],
        manifest["costs"],
        count,
        manifest.get("microBatchCandidates", []) if count == recorded else [],
    )


def resume(env: Env, found: checkpoint.Checkpoint, pipelines: Replicas, shards: Shards) -> int:
    """Load every stage's shard and optimizer state by the model's own names, from the files
    of the checkpoint that hold them (stage i of every replica the same: the checkpoint holds
    one copy, whatever the replica count that wrote it), the master's RNG states and the
    data's position (every replica's first stage's); the step the checkpoint was taken after.
    Either engine resumes the other's checkpoint. A stage process holding exactly the pieces
    a saved one held continues its RNG state; another gets a seed of its own from (seed,
    step, stage)."""
    index = checkpoint.index_of(found)
    manifest = found.manifest
    same = [shards.piece_units(i) for i in range(len(shards.ranges))] == manifest.get(
        "stages"
    ) and manifest.get("stagesPerProcess", 1) == env.spec.stages_per_process
    directory = str(found.directory)
    plans = []
    for k in range(env.spec.stages):
        names = [n for piece in shards.process_pieces(k) for n in shards.stages[piece].state_dict()]
        entries = checkpoint.sources(found, index, list(dict.fromkeys(names)))
        seed = None if same else env.spec.seed + 1_000_003 * found.step + k
        plans.append((entries, seed))
    loading = []
    for pipeline in pipelines.pipelines:
        for name, stage, (entries, seed) in zip(
            pipeline.names, pipeline.stages, plans, strict=True
        ):
            loading.append(on_stage_async(name, stage, Shard.load, directory, entries, seed))
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


def _origin(manifest: dict[str, Any], same: bool) -> str:
    """How the checkpoint's world was shaped, when this one is not cut as it was."""
    if same:
        return ""
    return (
        f", written by {manifest.get('stageCount', '?')} stages of the"
        f" {manifest.get('engine', 'rpc')} engine cut at"
        f" {', '.join(s[0] for s in manifest.get('stages', [])[1:]) or '?'}"
    )
