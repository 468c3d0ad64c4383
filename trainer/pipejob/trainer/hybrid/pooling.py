"""A parameter server's pooling of one group of its shards (`groups`: pooled alike, of one
width, one parameter) for a lookup, and the gradients of the rows it read from the gradient
of what it pooled. A summed group's rows' gradients are computed directly (each id's row
takes its bag's gradient), with no autograd graph and no gather of the rows: per-op costs
dominate at a batch's few thousand ids, and the graph, the gather and its backward cost a
server more than the pooling itself. A max group keeps its small graph (which row won each
column is the pooling's to say). docs/architecture.md, "A HybridJob's step"."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipejob.core.kinds.tables import Shard


def pooling(mode: str) -> str:
    """How a server pools a shard of a table of `mode`."""
    return "max" if mode == "max" else "sum"


def groups(shards: list[Shard]) -> list[tuple[str, int, list[int]]]:
    """Runs of a server's shards pooled alike, of one width: (pooling, dim, shard indices)."""
    out: list[tuple[str, int, list[int]]] = []
    for k, p in enumerate(shards):
        if out and out[-1][:2] == (pooling(p.mode), p.dim):
            out[-1][2].append(k)
        else:
            out.append((pooling(p.mode), p.dim, [k]))
    return out


@dataclass
class Pooled:
    """A group's lookup kept until its gradient comes: for a summed group each id's row and
    bag (None: one id a bag, in order); for a max group the rows it read (unique), their copy
    (the graph's leaf) and the pooled output (the graph's root)."""

    rows: torch.Tensor
    bags: torch.Tensor | None = None
    leaf: torch.Tensor | None = None
    out: torch.Tensor | None = None


def pool(
    weight: torch.Tensor, mode: str, ids: torch.Tensor, counts: torch.Tensor, keep: bool
) -> tuple[torch.Tensor, Pooled | None]:
    """The bags of `ids` (rows of `weight`, `counts` of them a bag, bag after bag) pooled by
    `mode` (sum or max): (bags, dim); and, with `keep`, what `row_gradients` needs."""
    offsets = torch.cumsum(counts, 0) - counts
    weight = weight.detach()
    if mode == "sum":
        out = F.embedding_bag(ids, weight, offsets, mode="sum")
        if not keep:
            return out, None
        if len(ids) == len(counts) and bool(counts.eq(1).all()):  # one id a bag (Criteo's)
            return out, Pooled(rows=ids)  # each id's bag is its own place
        bags = torch.repeat_interleave(torch.arange(len(counts)), counts)
        return out, Pooled(rows=ids, bags=bags)
    unique, inverse = torch.unique(ids, return_inverse=True)
    with torch.set_grad_enabled(keep):
        leaf = weight.index_select(0, unique).requires_grad_(keep)
        out = F.embedding_bag(inverse, leaf, offsets, mode=mode)
    if not keep:
        return out, None
    return out.detach(), Pooled(rows=unique, leaf=leaf, out=out)


def row_gradients(pooled: Pooled, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows a lookup read and their gradients (a row may come more than once) from
    `grad`, the gradient of its pooled bags (bags, dim)."""
    if pooled.leaf is None:  # a sum: each id's row gets its bag's gradient
        bags = pooled.bags
        return pooled.rows, grad if bags is None else grad.index_select(0, bags)
    assert pooled.out is not None
    torch.autograd.backward(pooled.out, grad)
    assert pooled.leaf.grad is not None
    return pooled.rows, pooled.leaf.grad
