"""PipelineJob: the master drives micro-batches through model shards on the stage workers.

- train.py: the master's loop (model, partition, steps, checkpoints, summary);
- shards.py + partition.py: the model cut into layers, balanced by measured cost, and
  `microBatches: auto`'s choice;
- schedule.py: one step, micro-batches pipelined through the stages over RPC;
- stage.py: a stage worker's shard, computing micro-batches in order;
- summary.py: the run's summary."""

from __future__ import annotations

from typing import Any

from pipejob.trainer.runtime import master, rendezvous
from pipejob.trainer.runtime.world import Env


def run(env: Env) -> dict[str, Any] | None:
    """Run this process's role of a PipelineJob; the master returns the summary."""
    from pipejob.trainer.pipeline import stage, train

    if env.role == "master":
        return master.drive(env, train.train)
    stages = env.spec.stages
    own = env.names("stage")[env.replica * stages : (env.replica + 1) * stages]
    if env.ddp_group is None:
        master.serve(env, *stage.stage_devices(env.role_index, own, env.gpus))
        return None
    import torch.distributed as dist

    # Stage i of every replica: the group that averages the shard's gradients.
    rendezvous.join_ddp(env)
    master.serve(env, *stage.stage_devices(env.role_index, own, env.gpus))
    dist.destroy_process_group()
    return None


def export_checkpoint(directory: Any, manifest: dict[str, Any], out: Any,
                      format: str = "safetensors") -> list[Any]:  # fmt: skip
    """`pipejob export` of this kind's checkpoint: the files spec.output writes."""
    from pipejob.trainer.pipeline import output

    return output.export_checkpoint(directory, manifest, out, format)
