"""auto's engine for a conformance row (issue 61): which engine a PipelineJob that names
none runs the row's model on, and why, in as many stages as the harness's first cut
(benchmarks/_conform.py: up to MAX_STAGES), chosen by the master's own functions
(engine_choice.for_inputs, then engine_choice.choose) from what the model passes into each
cut candidate. That is found as the stages find it when they measure a cut
(balance.measure_chain: the traced pieces' forward and backward on a micro-batch, once; on
the meta device where the model runs there, else on the real model), so the choice needs no
training: `conformance.py --engines` records it for
every row in minutes where the checks take hours. tests/test_engine_choice.py makes the
same choice for every example manifest.

pipejob's default loss is assumed (the cross-entropy, a mean over samples, with no label
ignored): a job's own loss or labels can still send it to rpc (the user guide's "Pipeline
engines and schedules"); the model alone decides the rest."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipejob.core import spec
from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline.balance import measure_chain
from pipejob.trainer.pipeline.cut_model import tensor_starts
from pipejob.trainer.pipeline.engine_choice import Choice, choose, for_inputs
from pipejob.trainer.pipeline.stage_build import CANDIDATES_PER_STAGE
from pipejob.trainer.workloads import materialize
from pipejob.trainer.workloads.cut import CutError, Traced, cut_count_error

EAGER = "the trace refused it: the eager path runs on rpc"
SHOWN_UNITS = 3  # of the places where the model passes other values, the table names these


def auto_job(stages: int) -> PipelineSpec:
    """The settings of a PipelineJob of `stages` stages that names no engine, loss or split
    points (the model's name is not read by the choice)."""
    manifest = {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": "conformance"},
        "spec": {"model": "resnet18", "stages": stages},
    }
    return spec.parse(manifest).settings


def auto_engine(
    build: Callable[[], nn.Module],
    x: Any,
    most: int,
    job_of: Callable[[int], PipelineSpec] = auto_job,
    labels: Any = None,
) -> Choice:
    """auto's choice for the model `build` makes, fed `x` (a micro-batch of its inputs) and
    `labels`, in the job `job_of(pieces)`, pieces being min(the model's cut candidates,
    `most`); rpc (the eager path) where the trace refuses it, as the master's is."""
    early = for_inputs(job_of(most), x, labels)
    if early is not None:
        return early
    want = CANDIDATES_PER_STAGE * most
    try:
        traced = Traced(materialize.build(build, ())[0], want, sample=x)
        units = traced.units
        if len(units) < 2:
            raise cut_count_error(len(units), 2, traced.whole)
    except CutError:
        return Choice("rpc", EAGER)
    starts = passes_tensors(build, traced, want, x)
    return choose(job_of(min(len(units), most)), units, starts, None)


def passes_tensors(
    build: Callable[[], nn.Module], traced: Traced, want: int, x: torch.Tensor
) -> list[bool]:
    """Per unit of `traced` (the model as the master traces it, on the meta device), whether
    the model passes only tensors into it: what the stages' one forward and backward of its
    pieces pass on, on the meta device (shapes alone: seconds for any size), or, where a
    piece needs values (data-dependent code, a buffer made in memory), on the real model."""
    units = traced.units
    try:
        pieces = traced.split(units[1:])
        costs, _ = measure_chain(pieces, units, (x.to("meta"),), True, 0, on_copies=False)
    except Exception:  # values needed: the stages' own way, in memory
        real = Traced(build(), want, sample=x)
        assert real.units == units, (real.units, units)
        pieces = real.split(units[1:])
        costs, _ = measure_chain(pieces, units, (x,), True, 0, on_copies=False)
    return tensor_starts(costs)


def said(choice: Choice) -> str:
    """The choice as the table's column says it: the engine, and for rpc why (naming the
    first SHOWN_UNITS places where the model passes other values, and how many more)."""
    if choice.engine == "pipelining":
        return choice.engine
    why = choice.why
    where = re.match(r"(.* where )(.+?)( begin.*)", why)
    if where is not None:
        units = where[2].split(", ")
        if len(units) > SHOWN_UNITS:
            more = f" and {len(units) - SHOWN_UNITS} more"
            why = where[1] + ", ".join(units[:SHOWN_UNITS]) + more + where[3]
    return f"rpc: {why}"
