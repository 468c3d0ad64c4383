"""What the PipelineJob master decides before the first step (`plan`): the stage processes
of each replica, the model's cut among them (a checkpoint's, or measured on the stages) and
the micro-batch count, checked against the data. docs/architecture.md ("Where a
PipelineJob's model and data live") says where each part of the model is built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipejob.core.kinds.pipeline import AUTO, INTERLEAVING, PIPELINING, RPC, PipelineSpec
from pipejob.trainer import workloads
from pipejob.trainer.pipeline import engine_choice
from pipejob.trainer.pipeline.balance import Host, shape
from pipejob.trainer.pipeline.counted_cost import MICRO_BATCH_OVERHEAD
from pipejob.trainer.pipeline.cut_model import (
    CutModel,
    Partition,
    plan_cut,
    share,
    stage_resources,
)
from pipejob.trainer.pipeline.engine_choice import Choice
from pipejob.trainer.pipeline.micro_batch_choice import candidate_table
from pipejob.trainer.pipeline.shape_check import fits_model
from pipejob.trainer.runtime import checkpoint, param_groups, world
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads import batch_values, data, materialize, models, staged
from pipejob.trainer.workloads.cut import CutError
from pipejob.trainer.workloads.synthetic import share_of


@dataclass(frozen=True)
class Plan:
    """What the master decides before the first step: which stage processes run the
    pipelines, how the model is cut among them (with the micro-batch count its costs were
    measured for, or the checkpoint's), the loss, and the checkpoint to resume from."""

    env: Env[PipelineSpec]  # the master's, its spec on the engine it runs (engine auto's choice)
    replicas: list[list[str]]  # replica r's stage processes, in order: each holds the cut
    cut_model: CutModel
    loss: workloads.Loss
    found: checkpoint.Checkpoint | None  # the newest complete checkpoint, if any

    @property
    def names(self) -> list[str]:
        """Replica 0's stage processes (what the cut is measured on, and the summary's)."""
        return self.replicas[0]

    @property
    def micro_batches(self) -> int:
        return self.cut_model.partition.micro_batches


@dataclass(frozen=True)
class Checked:
    """What the master checks by itself, needing no other member (`check`): the model built
    with none of its parameters, its numbering, the loss, and two samples that fit them."""

    model: nn.Module
    numbered: materialize.Numbering
    loss: workloads.Loss
    inputs: Any
    labels: Any


def check(env: Env[PipelineSpec]) -> Checked:
    """The model built with none of its parameters (the stages build their own pieces), its
    ties against spec.optimizer, and the data against it through the loss: refused (a
    ValueError naming the field and what to give) where they cannot work."""
    spec = env.spec
    model, numbered = models.build_meta(spec)
    param_groups.check_ties(spec.optimizer, model.named_parameters(remove_duplicate=False))
    loss = workloads.loss(spec)
    inputs, labels = checked_inputs(env, model, loss)
    return Checked(model, numbered, loss, inputs, labels)


def plan(env: Env[PipelineSpec], checked: Checked | None = None) -> Plan:
    """Decide the run before any step: the model checked (`check`, or what it found before
    the world formed: `checked`) and its cut, the checkpoint's where it fits this job, else
    measured on the stages, with the micro-batch count (`microBatches: auto`: the fastest
    predicted)."""
    spec = env.spec
    # Replica r's stages, in order: every replica holds the same pieces. The world runs as
    # many replicas as the plan gave it stages for (an elastic world: any of min..max).
    every = env.names("stage")
    count = len(every) // spec.stages
    replicas = [every[r * spec.stages : (r + 1) * spec.stages] for r in range(count)]
    c = checked if checked is not None else check(env)
    found = checkpoint.latest_for(env)
    cut_model, resumed = cut(env, c.model, c.numbered, replicas[0], found, c.inputs, c.labels)
    env = on_chosen_engine(env, cut_model.partition.engine)
    log_cut(env, cut_model, resumed)
    log_replicas(env, count)
    return Plan(env, replicas, cut_model, c.loss, found)


def on_chosen_engine(env: Env[PipelineSpec], choice: Choice | None) -> Env[PipelineSpec]:
    """With `engine: auto`: the master's env with its spec on the engine the cut chose,
    said in the log; else `env` as it is."""
    if choice is None:
        return env
    world.log(env, f"engine auto chose {choice.engine}: {choice.why}")
    return dataclasses.replace(env, spec=engine_choice.resolved(env.spec, choice.engine))


def checked_inputs(
    env: Env[PipelineSpec], model: nn.Module, loss: workloads.Loss
) -> tuple[Any, Any]:
    """The inputs and labels of two samples of the data, once they fit the model (data
    that does not is refused: shape_check.py). The first stage of each replica reads the batches
    (pipeline/reader.py): the master reads these two only."""
    spec = env.spec
    with data.Feed(spec) as feed:
        world.log(env, f"data: {feed.description}")
        inputs, labels = feed.sample(2)
    # A staged model runs as its stages call it (its own forward is not used).
    unchecked = fits_model(
        staged.as_called(spec, model) if spec.model.staged else model, inputs, labels, loss
    )
    if unchecked is not None:
        world.log(env, unchecked)
    return inputs, labels


def cut(
    env: Env[PipelineSpec],
    model: nn.Module,
    numbered: materialize.Numbering,
    names: list[str],
    found: checkpoint.Checkpoint | None,
    inputs: torch.Tensor,
    labels: Any = None,
) -> tuple[CutModel, bool]:
    """The model's cut among the stage processes `names`: the checkpoint's (`found`) where
    this job cuts the model as it did, else measured on the stages; and whether it is the
    checkpoint's."""
    early = engine_choice.for_inputs(env.spec, inputs, labels)  # engine auto: the data decides
    spec = env.spec if early is None else engine_choice.resolved(env.spec, early.engine)
    saved = None if found is None else saved_partition(env, found)
    try:
        if found is not None and saved is not None:
            cut_model = plan_cut(spec, model, numbered, names, saved)
            if cut_model.units_by_piece() == found.manifest.get("stages"):
                return cut_model, True
            # its cut is not this model's: measure anew
        threads, hosts = stage_resources(env, spec.stages, spec.gpus_per_stage > 0)
        world.log(env, measuring_line(env, names, threads, hosts, inputs))
        cut_model = plan_cut(
            spec, model, numbered, names, None, hosts, lambda message: world.log(env, message)
        )
        return (cut_model if early is None else cut_model.chosen_for(early)), False
    except ValueError as e:
        # A refused trace stays a CutError: the master may take the eager path instead.
        raise (CutError if isinstance(e, CutError) else ValueError)(
            f"spec.model {models.name(spec.model)} with {spec.stages} stages: {e}"
        ) from None


def measuring_line(
    env: Env[PipelineSpec], names: list[str], threads: int, hosts: list[Host], inputs: torch.Tensor
) -> str:
    """What the stages measure the cut's costs on, with what, and which of them share."""
    shared = "; ".join(
        f"{', '.join(names[k] for k in h.stages)} share "
        + ("a GPU" if h.gpu else f"{h.cpus:g} CPU(s)")
        for h in hosts
        if len(h.stages) > 1
    )
    what = f"{models.name(env.spec.model)}: the stages"
    if env.spec.deterministic:  # counted_cost.py: no timing, so no threads or sharing matter
        return (
            f"{what} count what each part costs (FLOPs and bytes moved, not timed:"
            f" spec.deterministic) on samples of shape {shape(batch_values.first(inputs))}"
        )
    return (
        f"{what} measure what each part costs on samples of"
        f" shape {shape(batch_values.first(inputs))}, with their {threads} intra-op"
        " thread(s)" + (f" ({shared})" if shared else "")
    )


def log_cut(env: Env[PipelineSpec], cut_model: CutModel, resumed: bool) -> None:
    """`microBatches: auto`'s choice (or the checkpoint's count) and what each stage holds."""
    spec = env.spec
    m, candidates = cut_model.partition.micro_batches, cut_model.partition.candidates
    if spec.micro_batches == AUTO:
        how = "resumes with the checkpoint's" if resumed else "chose"
        table = ":\n" + candidate_table(candidates, m) if candidates else ""
        world.log(
            env,
            f"microBatches auto {how} {m} (micro-batches of {spec.batch_size // m})"
            + (COUNTED_CHOICE if spec.deterministic else "")
            + table,
        )
    how = "counted" if spec.deterministic else "measured"
    for i in range(spec.stages):
        world.log(
            env, f"stage {i}: {cut_model.describe(i)}, {share(cut_model, i):.0%} of {how} cost"
        )


# How auto chooses under spec.deterministic (counted_cost.predict_counted), said in the log.
COUNTED_CHOICE = (
    " by counted cost (spec.deterministic): the slowest stage's count per micro-batch plus a"
    f" fixed {MICRO_BATCH_OVERHEAD:.0e} per micro-batch, times the schedule's slots"
    " (m + stages - 1; m x stagesPerProcess + stages - 1 interleaved), the same on every"
    " machine"
)


def log_replicas(env: Env[PipelineSpec], count: int) -> None:
    """How the `count` replicas share each batch, where there are or may be several."""
    spec = env.spec
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


def saved_partition(env: Env[PipelineSpec], found: checkpoint.Checkpoint) -> Partition | None:
    """The checkpoint's cut, when this job cuts the model into as many stages (at the same
    split points, if it names them): its measured costs need no new measuring, and each
    stage resumes from its own file. The micro-batch count is the job's, or with `auto` the
    checkpoint's. None: the job is shaped otherwise (or the checkpoint keeps no cut, or the
    rpc engine's, which may pass what the pipelining engine cannot), and the stages measure
    anew; any cut resumes any checkpoint of the model."""
    spec, manifest = env.spec, found.manifest
    checkpoint.fits(found, env, model=models.as_spec(spec.model))
    ranges, stages = manifest.get("ranges"), manifest.get("stages")
    recorded = manifest.get("microBatches")  # None: written before the count was kept
    count = recorded if spec.micro_batches == AUTO else spec.micro_batches
    if ranges is None or len(ranges) != spec.pieces or count is None:
        return None
    engine = manifest.get("engine") or RPC  # written before engines were kept: rpc's
    if engine != PIPELINING and (spec.engine == PIPELINING or spec.schedule in INTERLEAVING):
        return None
    # auto resumes on the engine its cut was made for
    choice = Choice(engine, "the checkpoint's cut was made for it") if spec.engine == AUTO else None
    if spec.split_points and list(spec.split_points) != [s[0] for s in stages[1:]]:
        return None
    return Partition(
        [range(a, b) for a, b in ranges],
        manifest["costs"],
        count,
        manifest.get("microBatchCandidates", []) if count == recorded else [],
        choice,
    )
