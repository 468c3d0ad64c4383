"""`spec.engine: auto`: which engine runs a job, chosen by the master when it cuts the model
(`choose`: pipelining where the stages pass each other only tensors, else rpc), and the life
of a stage process in such a world (`serve`): seated in the pipe group as on the pipelining
engine, serving whichever engine's Stage the master makes there."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.core.kinds.pipeline_schedules import (
    AUTO,
    GPIPE,
    INTERLEAVING,
    PIPELINING,
    RPC,
    loss_needs_rpc,
)
from pipejob.trainer.runtime import roles
from pipejob.trainer.runtime.world import Env


@dataclass(frozen=True)
class Choice:
    """The engine a job runs on, and why (what the summary and the log say)."""

    engine: str
    why: str


def choose(
    spec: PipelineSpec, units: list[str], starts: list[bool], fixed: list[range] | None
) -> Choice:
    """auto's engine for a cut of `units`, given where a piece may begin on the pipelining
    engine (`starts`: where the model passes only tensors). rpc where the pipelining engine
    cannot place the cut or compute the loss exactly, and the schedule lets rpc run it
    (gpipe, or 1f1b run as gpipe); an interleaved schedule runs on pipelining only."""
    loss = loss_needs_rpc(spec.loss.import_, spec.loss.args)
    refused = [units[r.start] for r in fixed or [] if not starts[r.start]]
    if loss is None and not refused and sum(starts) >= spec.pieces:
        return Choice(PIPELINING, "the stages pass each other only tensors")
    if spec.schedule in INTERLEAVING:
        return Choice(PIPELINING, f"spec.schedule {spec.schedule} runs on pipelining only")
    others = ", ".join(refused or [u for u, ok in zip(units, starts, strict=True) if not ok])
    why = loss or f"the model passes values other than tensors (ints, tuples) where {others} begin"
    if spec.schedule != GPIPE:
        why += f"; rpc runs gpipe, not {spec.schedule}"
    return Choice(RPC, why)


def for_inputs(spec: PipelineSpec, inputs: Any, labels: Any = None) -> Choice | None:
    """auto's choice where the data decides it before the cut: inputs other than a plain
    tensor (a dict, a tensor subclass such as MONAI's MetaTensor) run on rpc, whose stages
    carry them as one process sees them, and so do labels the cross-entropy leaves out
    (`ignored`); None where the cut decides."""
    if spec.engine != AUTO or spec.schedule in INTERLEAVING:
        return None
    if type(inputs) is torch.Tensor:
        why = ignored(spec, labels)
        if why is None:
            return None
    else:
        what = "a dict" if isinstance(inputs, dict) else type(inputs).__name__
        why = f"the data's inputs are {what}, which only the rpc engine's stages carry as they are"
    return Choice(
        RPC, why + (f"; rpc runs gpipe, not {spec.schedule}" if spec.schedule != GPIPE else "")
    )


def ignored(spec: PipelineSpec, labels: Any) -> str | None:
    """Why a sample of the data's labels takes rpc: a cross-entropy's ignore_index among
    them, so micro-batches count different numbers of labels and the pipelining engine's
    mean of their means is not the batch's mean (the rpc engine's one loss is); else None."""
    loss = spec.loss
    if loss.import_ is None:
        index = -100 if loss.cross_entropy is None else loss.cross_entropy.ignore_index
    elif loss.import_ == "torch.nn:CrossEntropyLoss":
        index = loss.args.get("ignore_index", -100)
    else:
        return None  # the user's loss: the cut's choice (choose) takes rpc unless a mean
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point():
        return None
    if not bool((labels == index).any()):
        return None
    return (
        f"the data's labels hold the cross-entropy's ignore_index ({index}), so micro-batches"
        " count different numbers of labels: only the rpc engine computes the batch's mean"
        " (name spec.engine pipelining to weigh each micro-batch alike)"
    )


def resolved(spec: PipelineSpec, engine: str) -> PipelineSpec:
    """`spec` as it runs on `engine` (rpc runs gpipe)."""
    if spec.engine != AUTO:
        return spec
    schedule = GPIPE if engine == RPC else spec.schedule
    return dataclasses.replace(spec, engine=engine, schedule=schedule)


def serve(env: Env) -> None:
    """A stage's life in an auto world: join the pipe group and divide it, as the
    pipelining engine does (the rpc engine's replicas average in its stage's group), with
    the rpc engine's device maps and autograd threads; then serve the master's calls."""
    import torch.distributed as dist

    from pipejob.trainer.pipeline import rpc, stage_groups
    from pipejob.trainer.pipeline.rpc.stage import stage_devices

    rpc.backward_threads(env)  # should the master choose rpc
    stages = env.spec.stages
    own = env.names("stage")[env.replica * stages : (env.replica + 1) * stages]
    stage_groups.join(env)
    roles.serve(env, *stage_devices(env.role_index, own, env.gpus))
    dist.destroy_process_group()
