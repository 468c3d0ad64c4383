"""Balance layers across pipeline stages: measure what each layer costs, then split exactly.

A pipeline runs at the pace of its slowest stage, so the split minimises the largest stage
cost over all contiguous splits (an exact dynamic program, not a heuristic)."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch

from pipejob.trainer.layers import Layer


def min_max_partition(costs: Sequence[float], parts: int) -> list[range]:
    """Split layers 0..n-1 into `parts` non-empty contiguous ranges, minimising the largest
    range's total cost. Among equally good splits, earlier stages get fewer layers."""
    n = len(costs)
    if parts < 1:
        raise ValueError(f"need at least one part, got {parts}")
    if n < parts:
        raise ValueError(f"cannot split {n} layers into {parts} non-empty stages")
    if any(c < 0 for c in costs):
        raise ValueError("layer costs must not be negative")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible largest cost when the first i layers form k stages;
    # cut[k][i]: where the last of those k stages starts in such a split.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for s in range(k - 1, i):  # the last stage is layers s..i-1
                worst = max(best[k - 1][s], prefix[i] - prefix[s])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, s
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def measure_costs(layers: list[Layer], sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Seconds each layer takes for forward + backward on `sample` (a micro-batch), the
    minimum over `repeats` runs after one untimed warm-up run (first calls set up kernels
    and memory). Runs on a copy so the model's BatchNorm statistics and gradients stay
    untouched."""
    layers = copy.deepcopy(layers)
    costs = [float("inf")] * len(layers)
    for run in range(repeats + 1):
        x = sample
        for i, (name, layer) in enumerate(layers):
            # Only the model's input needs no gradient; every later layer computes one for
            # its input, as it will in training. The clone lets in-place layers (ReLU) run.
            x = x.detach().requires_grad_(i > 0)
            x = x.clone() if i > 0 else x
            start = time.perf_counter()
            try:
                y = layer(x)
                y.backward(torch.ones_like(y))
            except RuntimeError as e:
                raise ValueError(
                    f"layer {name} cannot process an input of shape {tuple(x.shape)}: {e}"
                ) from None
            if run > 0:
                costs[i] = min(costs[i], time.perf_counter() - start)
            x = y
    return costs
