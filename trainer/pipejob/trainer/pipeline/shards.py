"""The model cut into layers and balanced across the stages by measured cost; with
`microBatches: auto`, the micro-batch count with the shortest predicted step (partition.py).
The master plans all of it on a model none of whose parameters exist; the stages build their
shards and measure the costs (parts.py)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from pipejob.core.kinds.pipeline import AUTO, PipelineSpec
from pipejob.trainer.pipeline.partition import (
    Host,
    LayerCosts,
    Prediction,
    fastest,
    micro_batch_counts,
    predict,
)  # fmt: skip
from pipejob.trainer.pipeline.parts import Part, measure_on_stages, trace
from pipejob.trainer.pipeline.stage import compute_resources
from pipejob.trainer.runtime import tuning
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads import cut, materialize, models


def hf_config(model: nn.Module) -> dict[str, Any] | None:
    """A Hugging Face PreTrainedModel's config as its config.json holds it, else None."""
    config = getattr(model, "config", None)
    if hasattr(model, "save_pretrained") and hasattr(config, "to_json_string"):
        return json.loads(config.to_json_string(use_diff=False))
    return None


@dataclass(frozen=True)
class Partition:
    """How the model is split and micro-batched: what a checkpoint keeps, since its shards
    fit no other split (costs are measured, so a new measurement may cut elsewhere)."""

    ranges: list[range]
    costs: list[float]  # measured seconds of forward + backward per layer, one micro-batch
    micro_batches: int  # the count the costs were measured for, and the run uses
    # With `microBatches: auto`: every candidate's prediction (see `candidate_table`).
    candidates: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Shards:
    """The model cut into one module per stage at the boundaries of a partition of its
    units (cut candidates in calling order, cut.Traced), and the model state no stage
    holds."""

    units: list[str]
    # Each stage's module: on the meta device where `parts` say how each stage builds its
    # own (what `plan_shards` gives); otherwise the modules themselves, sent to the stages.
    stages: list[nn.Module]
    partition: Partition
    rest: dict[str, torch.Tensor]
    # Parameters several stages hold (cut.ties): their gradients are summed every step.
    tied: list[list[tuple[int, str]]] = field(default_factory=list)
    # A Hugging Face model's config (config.json), written beside the model file.
    config: dict[str, Any] | None = None
    parts: list[Part] | None = None

    @property
    def ranges(self) -> list[range]:
        return self.partition.ranges

    @property
    def costs(self) -> list[float]:
        return self.partition.costs

    def of(self, stage: int) -> list[str]:
        """The names of the units stage `stage` holds."""
        return [self.units[i] for i in self.ranges[stage]]


def plan_shards(
    spec: PipelineSpec,
    model: nn.Module,
    numbered: materialize.Numbering,
    stage_names: list[str],
    saved: Partition | None = None,
    hosts: list[Host] | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> Shards:
    """Cut the job's `model`, built with none of its parameters (models.build_meta, which
    gives the `numbered` names), into spec.stages: at spec.splitPoints, or balanced by what
    each unit costs (measured on the stage processes `stage_names`, one pipeline's, on
    micro-batches of the first training batch, which the first stage reads), or as `saved`,
    a checkpoint's partition.
    With `microBatches: auto`, costs are measured at every candidate count's micro-batch
    size and the count with the shortest predicted step (given the `hosts` whose cores
    stages share) is used. Each stage builds its own shard from the returned `parts`."""
    traced = trace(spec, model)
    units = traced.units
    if len(units) < spec.stages:
        raise cut.cut_count_error(len(units), spec.stages)
    fixed = traced.ranges(spec.split_points) if spec.split_points else None
    if saved is None:
        saved = _measure(spec, stage_names, traced, numbered, hosts or [], fixed, progress)
    starts = [units[r.start] for r in saved.ranges[1:]]
    stages = traced.split(starts)
    dtype = torch.get_default_dtype()
    parts = [Part(spec, dtype, tuple(materialize.numbers(numbered, cut.state_names(stage))),
                  tuple(starts), (k,)) for k, stage in enumerate(stages)]  # fmt: skip
    rest = cut.unused(model, stages)
    # Parameters no stage holds, or buffers computed from parameters (the master's are not
    # right: it has no parameters), are built here.
    if any(v.device.type == "meta" or k in numbered.buffers for k, v in rest.items()):
        with torch.random.fork_rng(devices=[]):
            whole, _ = materialize.build(
                lambda: models.build(spec), materialize.numbers(numbered, rest)
            )
        rest = {k: v for k, v in whole.state_dict().items() if k in rest}
    return Shards(units, stages, saved, rest, cut.ties(stages), hf_config(model), parts)


def _measure(spec: PipelineSpec, stage_names: list[str], traced: cut.Traced,
             numbered: materialize.Numbering, hosts: list[Host], fixed: list[range] | None,
             progress: Callable[[str], None]) -> Partition:  # fmt: skip
    auto = spec.micro_batches == AUTO
    batch = spec.batch_size
    counts = micro_batch_counts(batch) if auto else [spec.micro_batches]
    for m in counts:
        progress(f"  micro-batch {batch // m} ({m} per batch)")
    sizes = [batch // m for m in counts]
    measured: dict[int, tuple[Prediction, LayerCosts]] = {}
    for m, costs in zip(counts, measure_on_stages(stage_names, spec, traced, numbered, sizes),
                        strict=True):  # fmt: skip
        measured[m] = predict(costs, spec.stages, m, batch, hosts, fixed), costs
    chosen, costs = measured[fastest([p for p, _ in measured.values()]).micro_batches]
    table = [candidate(p) for p, _ in measured.values()] if auto else []
    return Partition(chosen.ranges, costs.seconds, chosen.micro_batches, table)


def candidate(p: Prediction) -> dict[str, Any]:
    """One row of `microBatches: auto`'s table, as the summary and the checkpoint keep it."""
    return {
        "microBatches": p.micro_batches,
        "microBatchSize": p.micro_batch_size,
        "pipelineBoundSeconds": round(p.pipeline_seconds, 4),
        "coresBoundSeconds": round(p.cores_seconds, 4),
        "predictedStepSeconds": round(p.step_seconds, 4),
        "predictedSamplesPerSecond": round(p.samples_per_second, 2),
    }


def candidate_table(candidates: list[dict[str, Any]], chosen: int) -> str:
    """Per candidate: both bounds of the step (see partition.predict), the prediction."""
    lines = [f"  {'m':>3} {'micro':>5} {'pipeline s':>10} {'cores s':>7} {'predicted s/step':>16}"
             f" {'samples/s':>9}"]  # fmt: skip
    for c in candidates:
        mark = "  <- chosen" if c["microBatches"] == chosen else ""
        lines.append(f"  {c['microBatches']:>3} {c['microBatchSize']:>5}"
                     f" {c['pipelineBoundSeconds']:>10.3f} {c['coresBoundSeconds']:>7.3f}"
                     f" {c['predictedStepSeconds']:>16.3f}"
                     f" {c['predictedSamplesPerSecond']:>9.1f}{mark}")  # fmt: skip
    return "\n".join(lines)


def stage_resources(env: Env, stages: int) -> tuple[int, list[Host]]:
    """The intra-op threads the stages compute with (each decided by its own tuning, or by
    the user; the count most of them use, ties to the smaller), and the stages of one
    pipeline (`stages` of them) that share a host's cores (by address, as tuning counts
    them) with the CPUs they may use: with replicas, a host's CPUs are split among the
    replicas' stages on it, each pipeline getting its share."""
    names = env.names("stage")
    reports = [rpc.rpc_sync(name, compute_resources) for name in names]
    counts = Counter(threads for threads, _ in reports)
    address = dict(zip(env.world, env.addresses, strict=True))
    groups: list[list[int]] = []  # indices into `names` of the stages on one host
    for k, name in enumerate(names):
        group = [g for g in groups if tuning.same_host(address[names[g[0]]], address[name])]
        if group:
            group[0].append(k)
        else:
            groups.append([k])
    hosts = []
    for g in groups:
        ours = tuple(k for k in g if k < stages)  # replica 0's stages on this host
        if ours:
            cpus = min(reports[k][1] for k in g) * len(ours) / len(g)
            hosts.append(Host(ours, cpus))
    return min(counts, key=lambda n: (-counts[n], n)), hosts


def share(shards: Shards, stage: int) -> float:
    return sum(shards.costs[i] for i in shards.ranges[stage]) / sum(shards.costs)


def describe(layers: list[str]) -> str:
    if len(layers) == 1:
        return layers[0]
    return f"{layers[0]} .. {layers[-1]} ({len(layers)} layers)"
