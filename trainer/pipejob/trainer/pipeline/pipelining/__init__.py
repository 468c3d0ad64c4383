"""The pipelining engine: each stage process holds torch.distributed.pipelining PipelineStages
built from pipejob's own cut, and every stage of a replica steps the job's torch schedule
together over a process group; the master drives the rounds over RPC, but no activation
passes through it (docs/architecture.md, "Two pipeline engines, one PipelineJob").

- driver.py: the master's step driver;
- stage.py: a stage process's PipelineStages, schedule and optimizer;
- timed.py: its PipelineStage, marking when it computes, carrying a step's figures with the
  last backward's messages;
- schedules.py: spec.schedule as torch's schedule classes;
- messages.py: what the stage processes tell each other
  besides activations (a round's labels, a step's figures);
- activations.py: the activations a stage holds; flat_piece.py: a piece's outputs as the
  schedules pass them."""

from __future__ import annotations

from pipejob.trainer.runtime import roles
from pipejob.trainer.runtime.world import Env


def serve(env: Env) -> None:
    """A stage's life: join every stage in the pipe group and divide it
    (stage_groups.py), then serve the master's calls until it is done."""
    import torch.distributed as dist

    from pipejob.trainer.pipeline import stage_groups

    stage_groups.join(env)
    roles.serve(env)
    dist.destroy_process_group()
