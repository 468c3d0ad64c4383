"""PipelineJob: the master drives micro-batches through the model's shards on the stage
workers, on one of two engines (spec.engine): rpc/ (torch.distributed.rpc and distributed
autograd) or pipelining/ (torch.distributed.pipelining's stages and schedules), or the one the
master chooses (auto: engine_choice.py). Both share this room, and neither imports the other:

- run_plan.py: what the master decides before the first step (the cut, the micro-batches);
- train.py: the master's run (the steps, evaluation, checkpoints, output, summary);
- shards.py, balance.py, stage_parts.py: the model cut into pieces balanced by measured cost,
  each stage building its own, and `microBatches: auto`'s choice; counted_cost.py: the cost
  counted (FLOPs and bytes) instead of timed, for spec.deterministic;
- driver.py: what every engine's step driver does on the master;
- stage_base.py: what every engine's stage holds; reader.py: the first stage's data;
- gradients.py: the recipe between the backward and the optimizer's step;
- trained_model.py, summary.py, timing.py: the model out, the run's summary, when stages compute."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from pipejob.core.kinds.pipeline import AUTO, PipelineSpec
from pipejob.trainer.pipeline import engine_choice
from pipejob.trainer.runtime import roles
from pipejob.trainer.runtime.world import Env


def engine(spec: PipelineSpec, module: str = "") -> ModuleType:
    """The job's engine's package (its `serve`), or one of its modules (`driver`: the
    master's step driver)."""
    return importlib.import_module(f"{__name__}.{spec.engine}" + (f".{module}" if module else ""))


def run(env: Env) -> dict[str, Any] | None:
    """Run this process's role of a PipelineJob; the master returns the summary."""
    if env.role == "master":
        from pipejob.trainer.pipeline import train

        return roles.drive(env, train.train)
    if env.spec.engine == AUTO:
        engine_choice.serve(env)
    else:
        engine(env.spec).serve(env)
    return None


def export_checkpoint(
    directory: Any, manifest: dict[str, Any], out: Any, format: str = "safetensors"
) -> list[Any]:
    """`pipejob export` of this kind's checkpoint: the files spec.output writes."""
    from pipejob.trainer.pipeline import trained_model

    return trained_model.export_checkpoint(directory, manifest, out, format)
