"""The PipelineJob master's run, on either engine: the plan (run_plan.py), then the steps
through the engine's step driver, with evaluations, checkpoints (and the resume from one),
the trained model written out (trained_model.py) and the run's summary (summary.py)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path

from pipejob.core.averaged import BOTH
from pipejob.core.kinds.pipeline import AUTO, PIPELINING, RPC, PipelineSpec
from pipejob.core.workload import CUT_EAGER, CUT_TRACED
from pipejob.trainer.pipeline import ema_stages, peft_output, replicas_class, trained_model
from pipejob.trainer.pipeline.best_step import Judge
from pipejob.trainer.pipeline.cut_model import CutModel
from pipejob.trainer.pipeline.driver import PipelineBase, ReplicasBase
from pipejob.trainer.pipeline.eager import run as eager_run
from pipejob.trainer.pipeline.engine_choice import resolved
from pipejob.trainer.pipeline.master_checkpoints import resume, save_checkpoint
from pipejob.trainer.pipeline.reader import Reader
from pipejob.trainer.pipeline.run_plan import Checked, Plan, plan
from pipejob.trainer.pipeline.step_records import StepResult
from pipejob.trainer.pipeline.summary import render, report_evaluation, stage_report, summarize
from pipejob.trainer.runtime import (
    checkpoint,
    memory,
    monitor,
    profiling,
    roles,
    world,
)
from pipejob.trainer.runtime.events import Events
from pipejob.trainer.runtime.roles import SummaryBase
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads import data
from pipejob.trainer.workloads.cut import CutError
from pipejob.trainer.workloads.metrics import HeldOutEvaluation, Tally


def train(env: Env[PipelineSpec], checked: Checked | None = None) -> SummaryBase:
    """The PipelineJob master's run: the plan, the pipelines, the steps, the model out
    (`checked`: the master's check before the world formed, if it made one). Its summary:
    a run_json.PipelineSummary on the traced path, the eager path's its own (eager/run.py),
    only the keys every kind has where a checkpoint held every step."""
    spec = env.spec
    if spec.model.cut == CUT_EAGER:
        return eager(env, "spec.model.cut: eager")
    try:
        planned = plan(env, checked)
    except CutError as e:
        if spec.model.cut == CUT_TRACED or spec.engine == PIPELINING:
            raise
        return eager(env, f"the trace was refused: {e}")
    env, spec = planned.env, planned.env.spec  # on the engine it runs (engine auto's choice)
    monitor.board().runs_on(spec.engine)  # what `kubectl get` shows (status.engine)
    device = "cuda:0" if spec.gpus_per_stage > 0 else "cpu"
    pipelines = replicas_class(spec)(planned.replicas, planned.cut_model, spec, device)
    ema_stages.keep(spec, pipelines)  # spec.ema: before a checkpoint's average is loaded
    evaluates = held_out_description(env, pipelines) is not None
    first = 0 if planned.found is None else resume(env, planned.found, pipelines, planned.cut_model)
    started = time.perf_counter()
    judge = Judge.of(spec, first)  # spec.eval.best, earlyStopping
    results, evaluations = train_steps(env, planned, pipelines, evaluates, first, judge)
    pipelines.readers(Reader.close)
    if spec.output is not None and judge.step is None:  # else it holds the best step's
        write_output(env, pipelines, planned.cut_model, evaluations[-1] if evaluations else None)
    if not results:
        return roles.nothing_left(env, first)
    summary = summarize(
        env,
        planned.names,
        planned.cut_model,
        results,
        pipelines.timings(),
        first,
        pipelines.activation_peaks(),
    )
    summary["path"] = "traced"
    summary["replicaDivergence"] = pipelines.divergence()
    summary["wallSeconds"] = round(time.perf_counter() - started, 3)
    if evaluations:
        summary["evaluation"] = evaluations[-1]
        summary["evaluations"] = evaluations
    summary |= judge.figures()
    world.log(env, "summary:\n" + render(summary))
    return summary


def eager(env: Env[PipelineSpec], why: str) -> SummaryBase:
    """The eager path's run (`why`: what sent the job there), on the rpc engine: with
    `engine: auto`, its choice for a model whose forward the master runs, said as the cut's
    choice is (the log, the summary's engineChosen)."""
    chosen = "the eager path runs on rpc" if env.spec.engine == AUTO else None
    if chosen is not None:
        world.log(env, f"engine auto chose rpc: {chosen}")
    monitor.board().runs_on(RPC)
    summary = eager_run.train(dataclasses.replace(env, spec=resolved(env.spec, RPC)), why)
    return summary | ({"engineChosen": chosen} if chosen and summary else {})


# ---------------------------------------------------------------------------- the steps


def held_out_description(env: Env[PipelineSpec], pipelines: ReplicasBase) -> str | None:
    """The held-out set's description, where the job evaluates and the data has one."""
    if env.spec.eval is None:
        return None
    held = pipelines.pipelines[0].reader(Reader.held_out)
    world.log(
        env,
        f"evaluation: {held}"
        if held
        else "evaluation: the data has no held-out set; nothing to evaluate",
    )
    return held


def train_steps(
    env: Env[PipelineSpec],
    planned: Plan,
    pipelines: ReplicasBase,
    evaluates: bool,
    first: int,
    judge: Judge,
) -> tuple[list[StepResult], list[HeldOutEvaluation]]:
    """Steps first + 1 .. spec.steps: each step's result, and the evaluations (when the job
    `evaluates`), each recorded, checkpointed and logged when due, and `judge`d (the best
    written out; early stopping ends the steps)."""
    spec = env.spec
    profile = profiling.settings(spec)
    results: list[StepResult] = []
    evaluations: list[HeldOutEvaluation] = []
    monitor.board().phase("training")
    events = Events(spec.logging.tensorboard if spec.logging else None, first)
    try:
        for steps in runs(spec, first, profile, evaluates):
            for result, step in zip(
                run_results(env, pipelines, planned, steps, profile), steps, strict=True
            ):
                results.append(result)
                record_step(env, step, result, events)
                if checkpoint.due(spec, step + 1):
                    save_checkpoint(env, step + 1, pipelines, planned.cut_model)
                    events.flush()
                if (step + 1) % spec.log_every == 0 or step + 1 == spec.steps:
                    log_step(env, planned.names, pipelines, step, result, events)
                if evaluates and evaluation_due(spec, step + 1):
                    evaluations.append(evaluate(env, pipelines, planned, step + 1, events))
                    write = partial(
                        write_output, env, pipelines, planned.cut_model, evaluations[-1]
                    )
                    if judge.after(env, evaluations[-1], write if spec.output else None):
                        return results, evaluations
    finally:
        events.close()
    return results, evaluations


def runs(
    spec: PipelineSpec, first: int, profile: profiling.ProfileSettings | None, evaluates: bool
) -> Iterator[range]:
    """Steps first .. spec.steps - 1 (0-based) as runs the engine may send back to back
    (ReplicasBase.run_steps): a run ends where the loop does more after a step than record and
    log it (a checkpoint, an evaluation); a profiled step runs alone."""
    start = first
    for after in range(first + 1, spec.steps + 1):  # 1-based: after step `after`
        profiled = profile is not None and not profile.steps.isdisjoint({after, after + 1})
        evaluated = evaluates and evaluation_due(spec, after)
        if after == spec.steps or profiled or evaluated or checkpoint.due(spec, after):
            yield range(start, after)
            start = after


def run_results(
    env: Env[PipelineSpec],
    pipelines: ReplicasBase,
    planned: Plan,
    steps: range,
    profile: profiling.ProfileSettings | None,
) -> Iterable[StepResult]:
    """The results of a run of steps (`runs`), as they come; a step alone in its run is
    profiled where the spec asks (profiling.window)."""
    if len(steps) > 1:
        return pipelines.run_steps(planned.micro_batches, steps, planned.loss)
    with profiling.window(env, profile, steps.start + 1, env.names("stage")) as rpc_calls:
        with rpc_calls():
            return [pipelines.step(planned.micro_batches, steps.start, planned.loss)]


def record_step(env: Env[PipelineSpec], step: int, result: StepResult, events: Events) -> None:
    """The figures of step `step` (0-based) on the progress board and in the events."""
    spec = env.spec
    samples = spec.batch_size * spec.replicas.max * spec.gradient_accumulation  # per step
    if result.skipped is not None:  # a non-finite step skipped (spec.skipNonFiniteSteps)
        world.log(env, result.skipped)
    seconds = result.pipeline_seconds + result.optimizer_seconds
    monitor.board().step(step + 1, result.loss, seconds, samples)
    monitor.board().optimizer_figures(result.lr, result.grad_norm)
    events.scalars(
        step + 1,
        loss=result.loss,
        lr=result.lr,
        grad_norm=result.grad_norm,
        samples_per_second=samples / seconds,
    )


def log_step(
    env: Env[PipelineSpec],
    names: list[str],
    pipelines: ReplicasBase,
    step: int,
    result: StepResult,
    events: Events,
) -> None:
    """The line of step `step` (0-based) and the stages' times and memory behind it."""
    spec = env.spec
    samples = spec.batch_size * spec.replicas.max * spec.gradient_accumulation  # per step
    rate = samples / (result.pipeline_seconds + result.optimizer_seconds)
    world.log(
        env,
        f"step {step + 1}/{spec.steps}  loss {result.loss:.4f}"
        f"  {rate:.1f} samples/s  lr {result.lr:.3g}"
        f"  grad norm {result.grad_norm:.4g}",
    )
    board = monitor.board()
    bubble, times = stage_report(names, pipelines.timings(step), step, result)
    board.stages(bubble, times)
    memory.refresh(env, board)  # each member's peak, for /progress and /metrics
    events.scalars(step + 1, bubble=bubble)


def evaluation_due(spec: PipelineSpec, step: int) -> bool:
    assert spec.eval is not None
    every = spec.eval.every_steps
    return step == spec.steps or (every > 0 and step % every == 0)


def evaluate(
    env: Env[PipelineSpec], pipelines: ReplicasBase, planned: Plan, step: int, events: Events
) -> HeldOutEvaluation:
    """The held-out figures after `step`, through replica 0 (the replicas are identical),
    logged, on the progress board and in the events."""
    spec = env.spec
    assert spec.eval is not None
    start = time.perf_counter()
    tally = pipelines.evaluate(
        planned.micro_batches, spec.eval.batches, planned.loss, Tally(data.task(spec))
    )
    figures = HeldOutEvaluation(step=step, **tally.result())
    more = ""
    if spec.ema is not None:  # the average's figures beside the weights'
        with ema_stages.swapped(pipelines.pipelines[0]):
            tally = pipelines.evaluate(
                planned.micro_batches, spec.eval.batches, planned.loss, Tally(data.task(spec))
            )
        figures["ema"] = tally.result()
        more = f"; ema: loss {figures['ema']['loss']:.4f}"
    report_evaluation(env, figures, time.perf_counter() - start, more)
    events.scalars(
        step,
        eval_loss=figures["loss"],
        eval_accuracy=figures.get("accuracy"),
        eval_perplexity=figures.get("perplexity"),
    )
    return figures


def write_output(
    env: Env[PipelineSpec],
    pipelines: ReplicasBase,
    cut_model: CutModel,
    evaluation: HeldOutEvaluation | None,
) -> None:
    """The model replica 0's stages hold (`write_model`); with spec.ema, the average (ema),
    or the weights and, in the subfolder ema/, the average (both)."""
    spec = env.spec
    assert spec.output is not None
    pipeline = pipelines.pipelines[0]
    if spec.ema is None or spec.ema.output == BOTH:
        write_model(env, pipeline, cut_model, evaluation, spec.output.path)
    if spec.ema is not None:
        with ema_stages.swapped(pipeline):
            folder = Path(spec.output.path) / "ema" if spec.ema.output == BOTH else None
            write_model(env, pipeline, cut_model, evaluation, str(folder or spec.output.path))


def write_model(
    env: Env[PipelineSpec],
    pipeline: PipelineBase,
    cut_model: CutModel,
    evaluation: HeldOutEvaluation | None,
    out: str,
) -> None:
    """Every stage's state (replica 0's) and the state no stage holds under the model's own
    names, into `out`: one file for a small model, else each stage writes its own shard
    (pipeline/trained_model.py); the JSON beside them."""
    spec = env.spec
    assert spec.output is not None
    about = trained_model.info(env.kind, env.job, spec, spec.steps, evaluation)
    paths = trained_model.write_live(
        out,
        spec.output.format,
        pipeline.stages,
        cut_model.rest,
        about,
        cut_model.config,
        metadata=cut_model.metadata,
    )
    if cut_model.adapters:  # a peft model: its adapters as peft writes them, merged on request
        paths += peft_output.write(out, cut_model.adapters, spec.output.merged, cut_model.config)
    elif spec.output.merged:
        world.log(env, "output.merged: the model has no peft adapters; nothing to merge")
    world.log(env, f"model written: {', '.join(str(p) for p in paths)}")
