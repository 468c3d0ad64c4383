"""HybridJob: embedding tables on parameter servers, data-parallel dense models on the trainers.

master.py drives the run (board.py: what it hears from the trainers; run_summary.py: the
summary; model_writer.py: the trained model as files); trainer.py is a trainer's loop
(router.py: where its lookups go; dense_step.py: its dense model's averaged step;
evaluate.py: its checks and held-out figures); ps.py is a parameter server
(sparse_optimizers.py: how it steps the tables); records.py: what they hand each other and
write. How a step moves, and why: docs/architecture.md, "A HybridJob's step"."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipejob.trainer.runtime import rendezvous, roles, world
from pipejob.trainer.runtime.world import Env

if TYPE_CHECKING:  # the trainer's modules import torch: only once a role runs
    from pipejob.trainer.hybrid.model_writer import HybridManifest
    from pipejob.trainer.hybrid.records import HybridSummary


def run(env: Env, checked: None = None) -> HybridSummary | None:
    """Run this process's role of a HybridJob; the master returns the summary (`checked`:
    None, its master checks nothing before the world forms: Kind.checks_first)."""
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
    directory: str | Path, manifest: HybridManifest, out: str | Path, format: str = "safetensors"
) -> list[Path]:
    """`pipejob export` of this kind's checkpoint: the files spec.output writes."""
    from pipejob.trainer.hybrid import model_writer

    return model_writer.export_checkpoint(directory, manifest, out, format)
