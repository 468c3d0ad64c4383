"""PipelineJob: the master drives micro-batches through the model's pieces on the stage
workers, on one of two engines (spec.engine): rpc/ (torch.distributed.rpc and distributed
autograd) or pipelining/ (torch.distributed.pipelining's stages and schedules), or the one the
master chooses (auto: engine_choice.py). Both share this room, and neither imports the other:

- run_plan.py: what the master decides before the first step (the cut, the micro-batches);
- train.py: the master's run (the steps, evaluation, checkpoints, output, summary);
- cut_model.py, balance.py, stage_build.py: the model cut into pieces balanced by measured cost,
  each stage building its own, and `microBatches: auto`'s choice; counted_cost.py: the cost
  counted (FLOPs and bytes) instead of timed, for spec.deterministic;
- driver.py: what every engine's step driver does on the master;
- stage_base.py: what every engine's stage holds; reader.py: the first stage's data;
- gradients.py: the recipe between the backward and the optimizer's step;
- trained_model.py, summary.py, timing.py: the model out, the run's summary, when stages compute;
  run_json.py: the JSON a run writes (summary, evaluations, model.json) as TypedDicts."""

from __future__ import annotations

import importlib
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from pipejob.core.kinds.pipeline import AUTO, PIPELINING, RPC, PipelineSpec
from pipejob.trainer.pipeline import engine_choice
from pipejob.trainer.runtime import roles
from pipejob.trainer.runtime.world import Env

if TYPE_CHECKING:
    from pipejob.trainer.pipeline.driver import ReplicasBase
    from pipejob.trainer.pipeline.run_plan import Checked
    from pipejob.trainer.runtime.checkpoint_format import Manifest
    from pipejob.trainer.runtime.roles import SummaryBase

# Each engine's class of the master's handle on every replica, in its `driver` module.
REPLICAS_CLASS = {RPC: "RpcReplicas", PIPELINING: "PipeliningReplicas"}


def engine(spec: PipelineSpec, module: str = "") -> ModuleType:
    """The job's engine's package (its `serve`), or one of its modules (`driver`: the
    master's step driver)."""
    return importlib.import_module(f"{__name__}.{spec.engine}" + (f".{module}" if module else ""))


def replicas_class(spec: PipelineSpec) -> type[ReplicasBase]:
    """The job's engine's step driver on the master (`RpcReplicas`, `PipeliningReplicas`)."""
    return getattr(engine(spec, "driver"), REPLICAS_CLASS[spec.engine])


def check(env: Env) -> Checked:
    """The master's check before the world forms, where it starts first: its model against
    the data and the loss (run_plan.check; a refusal raises). What it built, for `run`."""
    from pipejob.trainer.pipeline import run_plan

    return run_plan.check(env)


def run(env: Env, checked: Checked | None = None) -> SummaryBase | None:
    """Run this process's role of a PipelineJob; the master returns the summary (`checked`:
    what its `check` built before the world formed, else it checks once the world formed)."""
    if env.role == "master":
        from pipejob.trainer.pipeline import train

        return roles.drive(env, partial(train.train, checked=checked))
    if env.spec.engine == AUTO:
        engine_choice.serve(env)
    else:
        engine(env.spec).serve(env)
    return None


def export_checkpoint(
    directory: str | Path, manifest: Manifest, out: str | Path, format: str = "safetensors"
) -> list[Path]:
    """`pipejob export` of this kind's checkpoint: the files spec.output writes."""
    from pipejob.trainer.pipeline import trained_model

    return trained_model.export_checkpoint(directory, manifest, out, format)
