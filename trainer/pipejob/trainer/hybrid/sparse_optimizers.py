"""The sparse optimizers a parameter server steps its shards of the tables with
(spec.sparseOptimizer): each changes only the rows a step touched, and their state. sgd,
adagrad and adam are torch.optim's own; rowwiseAdagrad (FBGEMM's, TorchRec's default for
tables) is written here. docs/architecture.md, "A HybridJob's step", says more."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pipejob.core.kinds.hybrid import SparseOptimizer


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row: for each touched row r with gradient g,
    sum[r] += mean(g ** 2) and row r -= lr * g / (sqrt(sum[r]) + eps). Takes sparse
    gradients only."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
    ):
        defaults = {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not p.grad.is_sparse:
                    raise RuntimeError("RowWiseAdagrad takes sparse gradients only")
                state = self.state[p]
                if not state:
                    state["sum"] = torch.full(
                        (p.shape[0],),
                        group["initial_accumulator_value"],
                        dtype=p.dtype,
                        device=p.device,
                    )
                grad = p.grad.coalesce()
                rows, values = grad.indices()[0], grad.values()
                if rows.numel() == 0:
                    continue
                # Gathered, changed and written back: the rows are unique (coalesced), and
                # index_add_ into a table of a million rows costs ten times as much.
                total = state["sum"].index_select(0, rows).add_(values.pow(2).mean(1))
                state["sum"].index_copy_(0, rows, total)
                std = total.sqrt_().add_(group["eps"]).unsqueeze(1)
                moved = p.index_select(0, rows).add_(values / std, alpha=-group["lr"])
                p.index_copy_(0, rows, moved)


def make(params: list[torch.Tensor], opt: SparseOptimizer) -> torch.optim.Optimizer:
    """spec.sparseOptimizer over `params` (tables, or shards of them)."""
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=opt.lr)
    accumulator = opt.initial_accumulator_value
    if opt.name == "adagrad":
        return torch.optim.Adagrad(
            params, lr=opt.lr, eps=opt.eps, initial_accumulator_value=accumulator
        )
    if opt.name == "rowwiseAdagrad":
        return RowWiseAdagrad(params, lr=opt.lr, eps=opt.eps, initial_accumulator_value=accumulator)
    if opt.name == "adam":
        return torch.optim.SparseAdam(params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)
    raise ValueError(f"unknown sparse optimizer {opt.name!r}")


def gradient(
    rows: torch.Tensor, values: torch.Tensor, shape: torch.Size, divisor: int = 1
) -> torch.Tensor:
    """A sparse gradient of a (rows, dim) table, coalesced: `values[k]` added to row
    `rows[k]` (a row may come more than once), the sums divided by `divisor`. Summed by a
    unique and an index_add into the touched rows alone: coalesce() sorts (ids, values)
    together and costs a server's step twice as much."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    summed = values.new_zeros((len(unique), *values.shape[1:])).index_add_(0, inverse, values)
    if divisor != 1:
        summed /= divisor
    return torch.sparse_coo_tensor(
        unique.unsqueeze(0), summed, shape, is_coalesced=True, check_invariants=False
    )
