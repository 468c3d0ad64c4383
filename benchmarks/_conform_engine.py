"""auto's engine for a conformance row (issue 61): which engine a PipelineJob that names
none runs the row's model on, and why, in as many stages as the harness's first cut
(benchmarks/_conform.py: up to MAX_STAGES), chosen by the master's own functions
(engine_choice.for_inputs, then engine_choice.choose) from what the model passes into each
cut candidate. That is found as the stages find it when they measure a cut
(balance.measure_chain: the traced pieces' forward and backward on a micro-batch, once, on
the real model), so the choice needs no training: `conformance.py --engines` records it for
every row in minutes where the checks take hours. tests/test_engine_choice.py makes the
same choice for every example manifest.

pipejob's default loss is assumed (the cross-entropy, a mean over samples, with no label
ignored): a job's own loss or labels can still send it to rpc (the user guide's "Pipeline
engines and schedules"); the model alone decides the rest."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch import nn

from pipejob.core import spec
from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline.balance import measure_chain
from pipejob.trainer.pipeline.engine_choice import Choice, choose, for_inputs
from pipejob.trainer.pipeline.shards import tensor_starts
from pipejob.trainer.pipeline.stage_parts import CANDIDATES_PER_STAGE
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
    try:
        traced = Traced(build(), want=CANDIDATES_PER_STAGE * most, sample=x)
        units = traced.units
        if len(units) < 2:
            raise cut_count_error(len(units), 2, traced.whole)
    except CutError:
        return Choice("rpc", EAGER)
    costs, _ = measure_chain(traced.split(units[1:]), units, (x,), True, 0, on_copies=False)
    return choose(job_of(min(len(units), most)), units, tensor_starts(costs), None)


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
