"""The sparse optimizers a parameter server steps its pieces of the tables with
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
                state["sum"].index_add_(0, rows, values.pow(2).mean(1))
                std = state["sum"][rows].sqrt_().add_(group["eps"])
                p.index_add_(0, rows, values / std.unsqueeze(1), alpha=-group["lr"])


def make(params: list[torch.Tensor], opt: SparseOptimizer) -> torch.optim.Optimizer:
    """spec.sparseOptimizer over `params` (tables, or pieces of them)."""
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


def gradient(rows: torch.Tensor, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A sparse gradient of a (rows, dim) table: `values[k]` added to row `rows[k]` (a row
    may come more than once)."""
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, shape, check_invariants=False)
