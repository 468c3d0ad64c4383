"""HybridJob: an EmbeddingBag on a parameter server, DDP dense models on the trainers.

- master.py: creates the table on the ps (`rpc.remote`), starts every trainer's loop
  (`rpc_async`, passing the table's RRef), prints progress, and returns the run's summary;
- ps.py: holds the table and, for each trainer, the optimizer that steps the table with that
  trainer's gradients; answers lookups and backward passes over RPC;
- trainer.py: forms the DDP group with the other trainers (its own port), then joins RPC and
  runs the loop the master calls;
- evaluate.py: the check that the dense module fits the data (before the first step) and
  the held-out evaluation (spec.eval), on DDP rank 0;
- output.py: the trained table and dense module as files (spec.output, `pipejob export`);
- summary.py: the run's summary.

Two round trips per step, where the tutorial's design (a DistributedOptimizer over the table's
and the dense parameters) takes four: the lookup, the backward, and the optimizer's step as an
RPC to the ps and one to the trainer itself. Here the ps steps the table as the lookup's
gradient arrives, inside the backward (`ps.Table.lookup`): when `dist_autograd.backward`
returns, the table is updated, exactly as after a DistributedOptimizer step (the same
torch.optim class, one per trainer, applied to the same gradient), and the next lookup sees
it."""

from __future__ import annotations

from typing import Any

from pipejob.trainer.runtime import master as roles
from pipejob.trainer.runtime import rendezvous, world
from pipejob.trainer.runtime.world import Env


def run(env: Env) -> dict[str, Any] | None:
    """Run this process's role of a HybridJob; the master returns the summary."""
    from pipejob.trainer.hybrid import master

    if env.role == "master":
        return roles.drive(env, master.train)
    if env.role == "trainer":
        import torch.distributed as dist

        rendezvous.join_ddp(env)
        world.log(env, f"joined the DDP group as rank {env.ddp_rank}/{env.ddp_world_size}"
                       f" ({env.ddp_backend})")  # fmt: skip
        roles.serve(env)  # serves the master's call to trainer.train until the world is done
        dist.destroy_process_group()
        return None
    roles.serve(env)  # the ps
    return None


def export_checkpoint(directory: Any, manifest: dict[str, Any], out: Any,
                      format: str = "safetensors") -> list[Any]:  # fmt: skip
    """`pipejob export` of this kind's checkpoint: the files spec.output writes."""
    from pipejob.trainer.hybrid import output

    return output.export_checkpoint(directory, manifest, out, format)
