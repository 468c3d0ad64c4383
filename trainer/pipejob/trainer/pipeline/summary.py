"""A PipelineJob run's summary: per-stage times, the measured bubble against GPipe's, and
`microBatches: auto`'s prediction against the run."""

from __future__ import annotations

from pipejob.core.kinds.pipeline import AUTO, PipelineSpec
from pipejob.trainer.pipeline import gradients
from pipejob.trainer.pipeline.cut_model import CutModel, share
from pipejob.trainer.pipeline.driver import StepResult
from pipejob.trainer.pipeline.run_json import (
    CurveFigures,
    PipelineSummary,
    RateFigures,
    SetupFigures,
    StageRow,
)
from pipejob.trainer.runtime import memory, monitor, param_groups, roles, world
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads import metrics, models
from pipejob.trainer.workloads.metrics import HeldOutEvaluation


def stage_report(
    names: list[str],
    timings: list[dict[int, tuple[float, float, float]]],
    step: int,
    result: StepResult,
) -> tuple[float, dict[str, tuple[float, float]]]:
    """One step's measured bubble and each stage's (forward, backward) seconds."""
    per_stage = [t.get(step, (0.0, 0.0, 0.0)) for t in timings]
    busy = sum(b for _, _, b in per_stage)
    bubble = max(0.0, 1 - busy / (len(per_stage) * result.pipeline_seconds))
    return bubble, {n: (f, b) for n, (f, b, _) in zip(names, per_stage, strict=True)}


def gpipe_bubble(stages: int, micro_batches: int, per_process: int = 1) -> float:
    """Idle fraction of a balanced GPipe (or 1F1B) pipeline: (p - 1) / (m + p - 1); of an
    interleaved one with v stages per process, (p - 1) / (m v + p - 1)."""
    return (stages - 1) / (micro_batches * per_process + stages - 1)


def summarize(
    env: Env[PipelineSpec],
    names: list[str],
    cut_model: CutModel,
    results: list[StepResult],
    timings: list[dict[int, tuple[float, float, float]]],
    first: int = 0,
    activations: list[int] | None = None,
) -> PipelineSummary:
    """The run's summary; `results` are of steps first, first + 1, ... Rates and times leave
    out the first step (warm-up: lazy allocations, optimizer state) unless it is the only
    one. Asks every member of the world for its peak memory (runtime/memory.py).
    `activations`: each stage's most bytes of activations held for its backwards, where its
    engine counts them."""
    spec = env.spec
    warmup = 1 if len(results) > 1 else 0
    measured = results[warmup:]
    steps = range(first + warmup, first + len(results))
    pipeline_wall = sum(r.pipeline_seconds for r in measured)
    peaks = memory.gather(env)
    for member, figures in peaks.items():
        monitor.board().memory(member, figures)  # the last /progress report has them too
    rows, busy_total = stage_rows(names, cut_model, timings, steps, pipeline_wall, peaks)
    if activations is not None:
        for i, row in enumerate(rows):
            row["peakActivationBytes"] = activations[i]
    p, m = spec.stages, cut_model.partition.micro_batches
    return PipelineSummary(
        **roles.summary(env, len(results), first),  # the keys every kind's summary has first
        **setup_figures(env, cut_model),
        warmupStepsExcluded=warmup,
        gradientAccumulation=spec.gradient_accumulation,
        precision=spec.precision,
        activationCheckpointing=spec.activation_checkpointing,
        **curve_figures(results),
        clipGradNorm=spec.optimizer.clip_grad_norm,
        parameterGroups=group_counts(spec, cut_model),
        **rate_figures(spec, measured),
        partition=rows,
        memory=peaks,  # every member's, the master's and every replica's stages' included
        bubble={
            "measured": round(1 - busy_total / (p * pipeline_wall), 4),
            "gpipeIdeal": round(gpipe_bubble(p, m), 4),
            "scheduleIdeal": round(gpipe_bubble(p, m, spec.stages_per_process), 4),
        },
    )


def group_counts(spec: PipelineSpec, cut_model: CutModel) -> dict[str, int]:
    """Per spec.optimizer group, its parameters' elements over the whole model (the pieces'
    modules, on the meta device where the stages build their own), a tied one counted once."""
    copies = gradients.copies(cut_model.tied)
    named = {
        name: p
        for k, piece in enumerate(cut_model.stages)
        for name, p in piece.named_parameters()
        if name not in copies.get(k % (cut_model.processes or len(cut_model.stages)), ())
    }
    return param_groups.counts(spec.optimizer, named.items())


def stage_rows(
    names: list[str],
    cut_model: CutModel,
    timings: list[dict[int, tuple[float, float, float]]],
    steps: range,
    pipeline_wall: float,
    peaks: dict[str, memory.Peak],
) -> tuple[list[StageRow], float]:
    """Each stage process's row of the summary's partition over the measured `steps`, and
    the seconds all of them were busy."""
    rows: list[StageRow] = []
    busy_total = 0.0
    for i, (name, per_step) in enumerate(zip(names, timings, strict=True)):
        forward, backward, busy = (sum(per_step[s][k] for s in steps) for k in range(3))
        busy_total += busy
        rows.append(
            StageRow(
                stage=name,
                layers=cut_model.process_units(i),
                pieces=cut_model.describe(i),
                costShare=round(share(cut_model, i), 4),
                forwardSeconds=round(forward / len(steps), 4),
                backwardSeconds=round(backward / len(steps), 4),
                idleFraction=round(1 - busy / pipeline_wall, 4),
                peakMemory=peaks.get(name),
            )
        )
    return rows, busy_total


def setup_figures(env: Env[PipelineSpec], cut_model: CutModel) -> SetupFigures:
    """The summary's fields that say how the job was set up: model, engine, cut, batches."""
    spec = env.spec
    return SetupFigures(
        model=models.name(spec.model),
        engine=spec.engine,
        engineChosen=choice.why if (choice := cut_model.partition.engine) else None,  # auto's
        schedule=spec.schedule,
        stages=spec.stages,
        stagesPerProcess=spec.stages_per_process,
        replicas=len(env.names("stage")) // spec.stages,  # the world's (elastic: any of min..max)
        # How the cut was chosen: given, counted (FLOPs and bytes) or timed on the stages.
        cutBy=cut_by(spec),
        microBatches=cut_model.partition.micro_batches,
        microBatchesRequested=spec.micro_batches,  # a count, or "auto"
        microBatchCandidates=cut_model.partition.candidates,  # auto's predictions
        batchSize=spec.batch_size,
        imageSize=spec.image_size,
    )


def cut_by(spec: PipelineSpec) -> str:
    """What the summary says chose the cut (spec.deterministic counts, counted_cost.py)."""
    if spec.split_points:
        return "splitPoints"
    return "counted" if spec.deterministic else "timed"


def curve_figures(results: list[StepResult]) -> CurveFigures:
    """Every step's loss, learning rate and gradient norm, and the first and last."""
    return CurveFigures(
        losses=[r.loss for r in results],  # in full: exactness tests compare them
        firstLoss=results[0].loss,
        finalLoss=results[-1].loss,
        learningRates=[r.lr for r in results],
        gradNorms=[r.grad_norm for r in results],
        finalGradNorm=results[-1].grad_norm,
    )


def rate_figures(spec: PipelineSpec, measured: list[StepResult]) -> RateFigures:
    """Samples a second and seconds a step, over the `measured` steps."""
    seconds = sum(r.pipeline_seconds + r.optimizer_seconds for r in measured)
    samples = spec.batch_size * spec.replicas.max * spec.gradient_accumulation * len(measured)
    return RateFigures(
        samplesPerSecond=round(samples / seconds, 3),
        secondsPerStep=round(seconds / len(measured), 4),
        allreduceSecondsPerStep=round(
            sum(r.allreduce_seconds for r in measured) / len(measured), 4
        ),
        optimizerSecondsPerStep=round(
            sum(r.optimizer_seconds for r in measured) / len(measured), 4
        ),
    )


def auto_line(s: PipelineSummary) -> list[str]:
    """How `microBatches: auto`'s prediction for its choice compares with the run (under
    spec.deterministic the prediction is a count, not seconds)."""
    chosen = [c for c in s["microBatchCandidates"] if c["microBatches"] == s["microBatches"]]
    if s["microBatchesRequested"] != AUTO or not chosen:
        return []
    measured = s["secondsPerStep"] - s["optimizerSecondsPerStep"]
    counts = ", ".join(str(c["microBatches"]) for c in s["microBatchCandidates"])
    head = f"  microBatches auto chose {s['microBatches']} of {counts}"
    if "predictedStepCount" in chosen[0]:
        return [
            f"{head} by counted cost (predicted {chosen[0]['predictedStepCount'] / 1e9:.2f} G"
            f" counted); measured {measured:.3f} s of forwards and backwards per step"
        ]
    return [
        f"{head}: predicted {chosen[0]['predictedStepSeconds']:.3f} s of forwards and backwards"
        f" per step, measured {measured:.3f}"
    ]


def recipe_line(s: PipelineSummary) -> list[str]:
    """The learning rate, gradient norm and clipping of the last step, and the recipe."""
    clip = s["clipGradNorm"]
    clipped = sum(1 for n in s["gradNorms"] if clip is not None and n > clip)
    parts = [
        f"last step lr {s['learningRates'][-1]:.3g}",
        f"gradient norm {s['finalGradNorm']:.4g}"
        + (f" (clipped to {clip:g} in {clipped} of {s['steps']} steps)" if clip else ""),
        s["precision"],
    ]
    if s["gradientAccumulation"] > 1:
        parts.append(f"{s['gradientAccumulation']} batches per optimizer step")
    if s["activationCheckpointing"]:
        parts.append("activation checkpointing")
    return ["  " + ", ".join(parts)]


def evaluation_line(s: PipelineSummary) -> list[str]:
    """The last evaluation's figures, where the run evaluated."""
    e = s.get("evaluation")
    if e is None:
        return []
    metric = "".join(f", {m}" for m in [metrics.describe(e)] if m)
    return [
        f"  held-out after step {e['step']}: loss {e['loss']:.4f}{metric} ({e['samples']} samples)"
    ]


def render(summary: PipelineSummary) -> str:
    """The summary as the master's log shows it: the run, the recipe, then a row a stage."""
    s = summary
    activated = any("peakActivationBytes" in st for st in s["partition"])
    lines = [
        f"  {s['model']}: {s['stages']} stages"
        + (f" of {s['stagesPerProcess']} pieces each" if s["stagesPerProcess"] > 1 else "")
        + f" on the {s['engine']} engine ({s['schedule']}), {s['microBatches']} micro-batches of"
        f" {s['batchSize'] // s['microBatches']}, {s['steps']} steps"
        + (
            f", {s['replicas']} replicas (all-reduce {s['allreduceSecondsPerStep']:.3f} s/step,"
            f" largest difference between replicas {s['replicaDivergence']:.3g})"
            if s["replicas"] > 1
            else ""
        ),
        f"  final loss {s['finalLoss']:.4f}; {s['samplesPerSecond']:.1f} samples/s,"
        f" {s['secondsPerStep']:.3f} s/step"
        + (" (step 1 is warm-up, left out)" if s["warmupStepsExcluded"] else ""),
        *recipe_line(s),
        *auto_line(s),
        *evaluation_line(s),
        f"  {'stage':<8} {'layers':<38} {'cost':>5} {'fwd s/step':>10} {'bwd s/step':>10}"
        f" {'idle':>5}  peak memory" + ("  (activations)" if activated else ""),
    ]
    for st in s["partition"]:
        peak = st.get("peakMemory")
        held = st.get("peakActivationBytes")
        lines.append(
            f"  {st['stage']:<8} {st['pieces']:<38} {st['costShare']:>5.0%}"
            f" {st['forwardSeconds']:>10.3f} {st['backwardSeconds']:>10.3f}"
            f" {st['idleFraction']:>5.0%}  {memory.megabytes(peak) if peak else '?'}"
            + (f"  ({held / 1e6:.1f} MB)" if held is not None else "")
        )
    staged = {st["stage"] for st in s["partition"]}
    others = [
        f"{name} {memory.megabytes(peak)}"
        for name, peak in s.get("memory", {}).items()
        if name not in staged
    ]
    if others:
        lines.append(f"  peak memory besides the stages above: {', '.join(others)}")
    b = s["bubble"]
    lines.append(
        f"  bubble {b['measured']:.0%} measured (idle share of stage time during forward and"
        f" backward), {s['schedule']} ideal "
        + ("(p-1)/(m+p-1)" if s["stagesPerProcess"] == 1 else "(p-1)/(mv+p-1)")
        + f" = {b['scheduleIdeal']:.0%}"
    )
    return "\n".join(lines)


def report_evaluation(
    env: Env[PipelineSpec], figures: HeldOutEvaluation, seconds: float, more: str = ""
) -> None:
    """An evaluation's figures (`more`: what follows its own) in the log and on the progress
    board, on either path."""
    metric = "".join(f", {m}" for m in [metrics.describe(figures)] if m) + more
    world.log(
        env,
        f"eval step {figures['step']}: loss {figures['loss']:.4f}{metric} on"
        f" {figures['samples']} held-out samples ({seconds:.1f}s)",
    )
    monitor.board().evaluated(
        figures["step"],
        figures["loss"],
        accuracy=figures.get("accuracy"),
        perplexity=figures.get("perplexity"),
    )
