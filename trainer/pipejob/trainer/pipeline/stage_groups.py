"""The stage processes' process groups, on the pipelining engine and in a world whose engine
the master chooses (spec.engine auto). The world plan seats every stage of every replica
in one group (`pipe`, stage i of replica r at rank r x stages + i), which each stage process
divides the same way: one group per replica's pipeline (its stages' activations and
gradients, point to point), its twin on gloo whatever the pipeline's backend (the stages'
own messages, messages.py) and, with replicas, one per stage index (the all-reduce that
averages a stage's gradients across replicas: the rpc engine's too, in an auto world)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pipejob.trainer.runtime import rendezvous
from pipejob.trainer.runtime.world import Env

_mine: tuple[Any, Any, Any] | None = None


def join(env: Env) -> None:
    """Join the pipe group (on the stage's GPU, where NCCL's communicators live) and divide
    it; the world's size is its stage count (elastic: any)."""
    import torch

    if env.gpus > 0:
        torch.cuda.set_device(0)
    rendezvous.join_ddp(env)
    replicas = len(env.names("stage")) // env.spec.stages
    divide(env.spec.stages, replicas, env.replica, env.role_index)


def divide(stages: int, replicas: int, replica: int, index: int) -> None:
    """Make the groups, in the same order on every stage process (each new group is a
    collective over the whole pipe group), and keep this process's."""
    import torch.distributed as dist

    global _mine
    timeout = timedelta(seconds=rendezvous.RPC_TIMEOUT_SECONDS)  # a step's calls' bound
    pipelines = [
        dist.new_group([r * stages + i for i in range(stages)], timeout=timeout)
        for r in range(replicas)
    ]
    twins = [
        dist.new_group([r * stages + i for i in range(stages)], timeout=timeout, backend="gloo")
        for r in range(replicas)
    ]
    across = (
        [
            dist.new_group([r * stages + i for r in range(replicas)], timeout=timeout)
            for i in range(stages)
        ]
        if replicas > 1
        else [None] * stages
    )
    _mine = pipelines[replica], across[index], twins[replica]


def divided() -> bool:
    """Whether this process divided the pipe group (a pipelining or auto world's stage)."""
    return _mine is not None


def mine() -> tuple[Any, Any, Any]:
    """This process's pipeline group, its replicas' group (None without replicas) and its
    pipeline's twin on gloo."""
    if _mine is None:
        raise RuntimeError("this process is not a stage of a world seated in the pipe group")
    return _mine
