"""HybridJob: embedding tables on parameter servers, DDP dense models on the trainers.

- master.py: has every parameter server make its pieces of the tables, starts every
  trainer's loop (`rpc_async`), and returns the run's summary;
- board.py: what the master hears from the trainers (progress, evaluations, checkpoints to
  complete), over RPC;
- ps.py: a parameter server: its pieces of the tables (core/kinds/tables.py places them) and
  their sparse optimizer (sparse_optimizers.py); answers each trainer's one call a step with the
  step's pooled embeddings, and steps the rows the trainers' gradients touch, once every
  trainer's are in;
- router.py: where a trainer's lookups go, and how the replies join into each table's
  pooled embeddings;
- trainer.py: forms the DDP group with the other trainers (its own port), then joins RPC
  and runs the loop the master calls;
- evaluate.py: the check that the dense module fits the data (before the first step) and
  the held-out evaluation (spec.eval), on DDP rank 0;
- model_writer.py: the trained tables and dense module as files (spec.output, `pipejob export`);
- run_summary.py: the run's summary and its lines.

Per step, each trainer makes one call to each server, all at once: the tutorial's design
(seed 002: a DistributedOptimizer over the table's and the dense parameters) makes four
round trips, a dense gradient of the whole table and one optimizer per trainer over it. Here
the call carries the ids the batch touches and the gradients of the previous step's pooled
embeddings, and only the rows they touch change, stepped once per step by one optimizer per
table."""

from __future__ import annotations

from typing import Any

from pipejob.trainer.runtime import rendezvous, roles, world
from pipejob.trainer.runtime.world import Env


def run(env: Env) -> dict[str, Any] | None:
    """Run this process's role of a HybridJob; the master returns the summary."""
    from pipejob.trainer.hybrid import master

    if env.role == "master":
        return roles.drive(env, master.train)
    if env.role == "trainer":
        import torch.distributed as dist

        rendezvous.join_ddp(env)
        world.log(
            env,
            f"joined the DDP group as rank {env.ddp_rank}/{env.ddp_world_size} ({env.ddp_backend})",
        )
        roles.serve(env)  # serves the master's call to trainer.train until the world is done
        dist.destroy_process_group()
        return None
    roles.serve(env)  # a parameter server
    return None


def export_checkpoint(
    directory: Any, manifest: dict[str, Any], out: Any, format: str = "safetensors"
) -> list[Any]:
    """`pipejob export` of this kind's checkpoint: the files spec.output writes."""
    from pipejob.trainer.hybrid import model_writer

    return model_writer.export_checkpoint(directory, manifest, out, format)
