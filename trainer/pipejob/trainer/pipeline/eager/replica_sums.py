"""A stage's gradients summed over the replicas on the eager path: every replica's copy of the
stage gathers every other's (its stage index's collective group) and adds them in replica
order, so each replica gets the same bits, run after run, whatever the collective's own
reduction order. A parameter gets a gradient where any replica gave it one (the glue's
data-dependent Python may call a module in one replica's micro-batches and not another's)."""

from __future__ import annotations

from typing import Any

import torch

from pipejob.trainer.pipeline import stage_groups


def group() -> Any:
    """The group of this stage index's copies: an auto world's own (stage_groups.py), else
    the default one (a rpc world's stages join only theirs, the plan's `dp`)."""
    return stage_groups.mine()[1] if stage_groups.divided() else None


def summed(
    grads: dict[torch.Tensor, torch.Tensor], params: list[torch.Tensor], replicas: int
) -> dict[torch.Tensor, torch.Tensor]:
    """`grads` (this replica's, by parameter) summed with every replica's in replica order,
    for the parameters `params` (the same list, in the same order, in every replica)."""
    if replicas == 1:
        return grads
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    total: dict[torch.Tensor, torch.Tensor] = {}
    for ps in by_dtype.values():  # one gather per dtype: each keeps its own precision
        total |= _summed_of(grads, ps, replicas)
    return total


def _summed_of(
    grads: dict[torch.Tensor, torch.Tensor], params: list[torch.Tensor], replicas: int
) -> dict[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    def flat(p: torch.Tensor) -> torch.Tensor:
        g = grads.get(p)
        return torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if g is None else g.flatten()

    # The gradients, then one flag per parameter: whether this replica gave it one.
    present = torch.tensor([float(p in grads) for p in params], device=params[0].device)
    mine = torch.cat([*(flat(p) for p in params), present.to(params[0].dtype)])
    gathered = [torch.empty_like(mine) for _ in range(replicas)]
    dist.all_gather(gathered, mine, group=group())
    added = gathered[0].clone()
    for other in gathered[1:]:  # in replica order: the same sum in every replica
        added += other
    sizes = [p.numel() for p in params]
    values = added[: sum(sizes)].split(sizes)
    flags = added[sum(sizes) :]
    return {
        p: value.view_as(p)
        for p, value, flag in zip(params, values, flags.tolist(), strict=True)
        if flag > 0
    }
