"""The master's run on the eager path: the model built and its costly modules placed on the
stages (placement.py, checked in one process: check.py), the steps (one_step.py), the trained
model written out under the model's own names, and the run's summary, which says which path
the job took and why."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from torch import nn

from pipejob.core.averaged import BOTH
from pipejob.core.kinds.pipeline import AUTO, PIPELINING, PipelineSpec
from pipejob.core.kinds.pipeline_schedules import EAGER_SPLIT_POINTS
from pipejob.trainer import workloads
from pipejob.trainer.pipeline import trained_model
from pipejob.trainer.pipeline.best_step import Judge
from pipejob.trainer.pipeline.eager import held_out, moving_average, one_step, remote, saved
from pipejob.trainer.pipeline.eager.check import check
from pipejob.trainer.pipeline.eager.moving_average import Averages
from pipejob.trainer.pipeline.eager.placement import (
    Placement,
    describe,
    no_grad_run,
    place,
    replace,
    under_every_name,
)
from pipejob.trainer.pipeline.gradients import LossScale
from pipejob.trainer.pipeline.run_json import BestFigures, CurveFigures, RateFigures
from pipejob.trainer.pipeline.stage_base import AUTOCAST
from pipejob.trainer.pipeline.step_records import StepResult
from pipejob.trainer.pipeline.summary import curve_figures, rate_figures
from pipejob.trainer.runtime import checkpoint, monitor, nonfinite, roles, world
from pipejob.trainer.runtime.checkpoint import OptimizerLike
from pipejob.trainer.runtime.optim import Functional, learning_rate
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads import data, models
from pipejob.trainer.workloads.batch_values import split
from pipejob.trainer.workloads.metrics import HeldOutEvaluation


def refusal(spec: PipelineSpec) -> str | None:
    """Why this job cannot take the eager path, if it cannot (said before anything runs)."""
    if spec.engine == PIPELINING:
        return "the eager path runs on the rpc engine only: set spec.engine: rpc"
    if spec.model.staged is not None:
        return "spec.model.staged replaces the model's forward, which the eager path runs"
    # Parts of the recipe the eager path does not carry yet: refused, never ignored.
    if spec.profile is not None:
        return "the eager path does not profile yet: leave spec.profile out"
    if spec.split_points:
        return f"the eager path {EAGER_SPLIT_POINTS}"
    return None


def micro_batches(spec: PipelineSpec) -> int:
    """The job's count, or with `auto` the most up to twice the stages that divides the batch."""
    if spec.micro_batches != AUTO:
        return int(spec.micro_batches)
    return max(m for m in range(1, 2 * spec.stages + 1) if spec.batch_size % m == 0)


def placed(env: Env[PipelineSpec], model: nn.Module, m: int) -> Placement:
    """The placement of the model's modules on the stages, measured (spec.deterministic:
    counted) on one micro-batch of the data and checked in one process (check.py)."""
    spec = env.spec
    with data.Feed(spec) as feed:
        world.log(env, f"data: {feed.description}")
        size = max(1, spec.batch_size // m)
        inputs, _ = feed.sample(2 * size)
    first, second = split(inputs, 2)
    run = no_grad_run(model, first)
    run()  # warm-up: the first call of a kernel costs more than the next
    other = no_grad_run(model, second)
    counted = spec.deterministic  # counted_cost.py: two runs place alike, whatever the load
    if counted:
        world.log(env, "the stages count what each module costs (spec.deterministic)")
    placement = check(model, run, lambda kept: place(model, run, spec.stages, kept, counted), other)
    for line in describe(placement):
        world.log(env, line)
    for name, why in placement.kept.items():
        world.log(env, f"kept with the master's glue: {name} ({why})")
    return placement


def distribute(env: Env[PipelineSpec], model: nn.Module, placement: Placement) -> one_step.Stages:
    """Each stage of each replica builds its modules; on the master they are replaced by
    stand-ins that call them there, on the calling micro-batch's replica (the master keeps
    only the glue's parameters, one copy that every replica's micro-batches use)."""
    spec = env.spec
    names = env.names("stage")
    replicas = len(names) // spec.stages  # the world's: an elastic one's may be fewer
    workers = [names[r * spec.stages : (r + 1) * spec.stages] for r in range(replicas)]
    device = "cuda:0" if spec.gpus_per_stage > 0 else "cpu"
    held = [
        [
            remote.hold(w, spec, modules, device, replicas)
            for w, modules in zip(own, placement.stages, strict=True)
        ]
        for own in workers
    ]
    for i, modules in enumerate(placement.stages):
        places = [(workers[r][i], held[r][i]) for r in range(replicas)]
        for name in modules:  # under every name it has: one module, on one stage
            replace(model, name, remote.OnStage(name, places))
    return one_step.Stages(workers, held)


class EagerFigures(roles.SummaryBase, CurveFigures, RateFigures):
    """What every eager-path run's summary has (`summarize`'s): the placement, and the
    curves' and rates' figures as the traced path's summary has them (pipeline/run_json.py)."""

    path: str  # "eager"
    pathReason: str
    model: str
    stages: int
    replicas: int
    engine: str
    microBatches: int
    batchSize: int
    gradientAccumulation: int
    glueParameters: int
    placement: list[list[str]]  # per stage, its modules
    cutBy: str  # "counted" or "timed"
    keptWithGlue: dict[str, str]  # module: why the master keeps it
    forwardsOneAtATime: bool


class EagerSummary(EagerFigures, BestFigures, total=False):
    """An eager-path run's summary (summary.json): `summarize`'s figures, then what `train`
    adds after the steps: the replicas' divergence, the wall time, the evaluations (with
    spec.eval) and Judge.figures' (with spec.eval.best)."""

    replicaDivergence: float
    wallSeconds: float
    evaluation: HeldOutEvaluation  # the last
    evaluations: list[HeldOutEvaluation]
    engineChosen: str  # why engine auto chose the engine (pipeline/train.py adds it)


@dataclass
class EagerState:
    """What the master trains with: the model (the glue, with stand-ins for the stages'
    modules), the glue's optimizer, the stages, the placement, spec.ema's averages, fp16's
    loss scale."""

    model: nn.Module
    glue: Functional | None
    stages: one_step.Stages
    placement: Placement
    averages: Averages | None
    scale: LossScale | None = None

    def kept(self) -> dict[str, OptimizerLike]:
        return moving_average.kept(self.glue, self.averages)


def train(env: Env[PipelineSpec], why: str) -> EagerSummary | roles.SummaryBase:
    """The master's run on the eager path (`why`: how the job came to take it)."""
    spec = env.spec
    world.log(env, f"path: eager ({why})")
    refused = refusal(spec)
    if refused is not None:
        raise ValueError(f"spec.model: {why}, and {refused}")
    m = micro_batches(spec)
    model = models.build(spec)
    model.train()
    placement = placed(env, model, m)
    stages = distribute(env, model, placement)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # the glue's
    glue = Functional(spec.optimizer, params) if params else None
    averages = None if spec.ema is None else Averages(spec, model, stages)  # before a resume
    scale = LossScale() if spec.precision == "fp16" else None
    t = EagerState(model, glue, stages, placement, averages, scale)
    started = time.perf_counter()
    with data.Feed(spec) as feed:
        found = checkpoint.latest_for(env)
        first = 0 if found is None else saved.resume(env, found, t, feed)
        judge = Judge.of(spec, first)  # spec.eval.best, earlyStopping
        results, evaluations = steps(env, t, feed, m, first, judge)
    if spec.output is not None and judge.step is None:  # else it holds the best step's
        write_output(env, t, evaluations[-1] if evaluations else None)
    if not results:
        return roles.nothing_left(env, first)
    held = sum(p.numel() for p in model.parameters())  # the stand-ins hold none
    summary = summarize(env, why, placement, m, results, first, held)
    summary["replicaDivergence"] = stages.divergence()
    summary["wallSeconds"] = round(time.perf_counter() - started, 3)
    if evaluations:
        summary["evaluation"] = evaluations[-1]
        summary["evaluations"] = evaluations
    summary |= judge.figures()
    world.log(env, "summary:\n" + render(summary))
    return summary


def steps(
    env: Env[PipelineSpec], t: EagerState, feed: data.Feed, m: int, first: int, judge: Judge
) -> tuple[list[StepResult], list[HeldOutEvaluation]]:
    """Steps first + 1 .. spec.steps, each logged, checkpointed and evaluated when due, each
    evaluation `judge`d (the output written at a new best; early stopping ends the run)."""
    spec = env.spec
    loss = workloads.loss(spec)
    held = data.held_out(spec) if spec.eval is not None else None
    if spec.eval is not None and held is None:
        world.log(env, "evaluation: the data has no held-out set; nothing to evaluate")
    monitor.board().phase("training")
    results: list[StepResult] = []
    evaluations: list[HeldOutEvaluation] = []
    rules = spec.optimizer.clip_grad_norm, nonfinite.Guard(spec.skip_non_finite_steps)
    forward = partial(one_step.computed, t.model, autocast=AUTOCAST[spec.precision])
    serial = t.placement.one_at_a_time()
    for number in range(first, spec.steps):
        lr = learning_rate(spec.optimizer, spec.steps, number)
        batches = [feed.batch() for _ in range(spec.gradient_accumulation)]
        done = one_step.step(
            forward, t.glue, t.stages, batches, m, number, loss, rules, lr, serial, t.scale
        )
        if done.applied and t.averages is not None:  # spec.ema: an applied step
            t.averages.update()
        results.append(logged(env, number, done))
        if checkpoint.due(spec, number + 1):
            saved.save(env, number + 1, t, feed)
        if held is not None and held_out.due(spec, number + 1):
            evaluations.append(
                held_out.evaluate(env, held, t.model, t.stages, loss, number + 1, t.averages)
            )
            write = partial(write_output, env, t, evaluations[-1])
            if judge.after(env, evaluations[-1], write if spec.output else None):
                break
    if held is not None:
        held.close()
    return results, evaluations


def logged(env: Env[PipelineSpec], number: int, done: one_step.Step) -> StepResult:
    """Step `number` (0-based)'s result, logged when due and on the progress board."""
    spec = env.spec
    if done.skipped is not None:  # a non-finite step skipped (spec.skipNonFiniteSteps)
        world.log(env, done.skipped)
    samples = spec.batch_size * spec.replicas.max * spec.gradient_accumulation  # a step's
    monitor.board().step(number + 1, done.loss, done.seconds, samples)
    if (number + 1) % spec.log_every == 0 or number + 1 == spec.steps:
        world.log(
            env,
            f"step {number + 1}/{spec.steps}  loss {done.loss:.4f}"
            f"  {samples / done.seconds:.1f} samples/s  lr {done.lr:.3g}"
            f"  grad norm {done.grad_norm:.4g}",
        )
    return StepResult(
        done.loss, done.seconds, 0.0, lr=done.lr, grad_norm=done.grad_norm, skipped=done.skipped
    )


def write_output(
    env: Env[PipelineSpec], t: EagerState, evaluation: HeldOutEvaluation | None
) -> None:
    """The trained model under the model's own names: with spec.ema, the average (ema), or
    the weights and, in the subfolder ema/, the average (both)."""
    spec = env.spec
    assert spec.output is not None
    if t.averages is None or spec.ema is None or spec.ema.output == BOTH:
        write_model(env, t, evaluation, spec.output.path)
    if t.averages is not None and spec.ema is not None:
        with t.averages.swapped():
            folder = Path(spec.output.path) / "ema" if spec.ema.output == BOTH else None
            write_model(env, t, evaluation, str(folder or spec.output.path))


def write_model(
    env: Env[PipelineSpec], t: EagerState, evaluation: HeldOutEvaluation | None, out: str
) -> None:
    """The model as one file in `out`: the glue's state (the master's) and every stage's
    (replica 0's)."""
    spec = env.spec
    assert spec.output is not None
    about = trained_model.info(env.kind, env.job, spec, spec.steps, evaluation)
    glue = {k: v for k, v in t.model.state_dict().items()}
    states = [under_every_name(s, t.placement.also) for s in t.stages.on_each(remote.state)]
    paths = trained_model.write(out, spec.output.format, states, glue, about)
    world.log(env, f"model written: {', '.join(str(p) for p in paths)}")


def summarize(
    env: Env[PipelineSpec],
    why: str,
    placement: Placement,
    m: int,
    results: list[StepResult],
    first: int,
    glue_parameters: int,
) -> EagerSummary:
    """The run's summary as the steps leave it (`train` adds the rest)."""
    spec = env.spec
    measured = results[1:] or results
    return roles.summary(
        env,
        len(results),
        first,
        path="eager",
        pathReason=why,
        model=models.name(spec.model),
        stages=spec.stages,
        replicas=len(env.names("stage")) // spec.stages,  # the world's (elastic: any)
        engine=spec.engine,
        microBatches=m,
        batchSize=spec.batch_size,
        gradientAccumulation=spec.gradient_accumulation,
        glueParameters=glue_parameters,  # what the master holds of the model
        placement=placement.stages,
        cutBy="counted" if placement.counted else "timed",  # as the traced cut's summary says
        keptWithGlue=placement.kept,
        forwardsOneAtATime=placement.one_at_a_time(),  # else the micro-batches' at once
        **curve_figures(results),
        **rate_figures(spec, measured),
    )


def render(s: EagerSummary) -> str:
    """The summary as the log says it."""
    lines = [
        f"  {s['model']}: eager path ({s['pathReason']}), {s['stages']} stages,"
        f" {s['microBatches']} micro-batches of {s['batchSize'] // s['microBatches']},"
        f" {s['steps']} steps"
        + (f", {s['replicas']} replicas" if s["replicas"] > 1 else "")
        + (
            f", {s['gradientAccumulation']} batches per optimizer step"
            if s["gradientAccumulation"] > 1
            else ""
        ),
        f"  final loss {s['finalLoss']:.4f}; {s['samplesPerSecond']:.1f} samples/s,"
        f" {s['secondsPerStep']:.3f} s/step",
    ]
    lines.append(f"  placed by {'counted' if s['cutBy'] == 'counted' else 'measured'} cost")
    lines += [f"  stage {i}: {', '.join(names)}" for i, names in enumerate(s["placement"])]
    if s["replicas"] > 1:
        lines.append(f"  largest difference between replicas {s['replicaDivergence']:.3g}")
    lines += [f"  kept with the glue: {n} ({why})" for n, why in s["keptWithGlue"].items()]
    if s["forwardsOneAtATime"]:
        lines.append(
            "  the micro-batches' forwards run one at a time, in order: a module kept with"
            " the glue changes Python state that the glue reads"
        )
    return "\n".join(lines)
