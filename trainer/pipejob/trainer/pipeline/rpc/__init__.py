"""The rpc engine: a round is one call from the master to the first stage, and each stage
passes every micro-batch on to the next over torch.distributed.rpc; distributed autograd runs
the backward across them, and each stage's optimizer steps its shard where it lives.

- driver.py: the master's step driver (GPipe);
- stage.py: a stage worker's shard, computing micro-batches in order (turnstile.py) and
  passing them on;
- round_end.py: what ends a round, on the last stage and on the way back."""

from __future__ import annotations

from pipejob.trainer.runtime import rendezvous, roles
from pipejob.trainer.runtime.world import Env


def serve(env: Env) -> None:
    """A stage's life: serve the master's calls; with replicas, in the group of stage i of
    every replica, which averages the shard's gradients."""
    from pipejob.trainer.pipeline.rpc.stage import stage_devices

    backward_threads(env)
    stages = env.spec.stages
    own = env.names("stage")[env.replica * stages : (env.replica + 1) * stages]
    if env.ddp_group is None:
        roles.serve(env, *stage_devices(env.role_index, own, env.gpus))
        return
    import torch.distributed as dist

    rendezvous.join_ddp(env)
    roles.serve(env, *stage_devices(env.role_index, own, env.gpus))
    dist.destroy_process_group()


def backward_threads(env: Env) -> None:
    """Enough autograd threads that the micro-batch whose turn it is always has one
    (backward_order.py): one more than the micro-batches, at most one a sample with `auto`.
    Before anything runs: torch sets the count once."""
    import torch

    from pipejob.trainer.pipeline.rpc.backward_order import interop_threads

    spec = env.spec
    most = spec.micro_batches if isinstance(spec.micro_batches, int) else spec.batch_size
    torch.set_num_interop_threads(interop_threads(most, torch.get_num_interop_threads()))
