"""What each piece of the model costs, counted instead of timed (spec.deterministic): its
forward + backward FLOPs (torch's FlopCounterMode) plus the bytes it moves, so that every
run of one manifest cuts the model where the last did (and the eager path places its
modules where the last did), whatever else shares the machine; and `microBatches: auto`'s
count predicted from the counts (`predict_counted`), so every run chooses alike.
How and why: the user guide's "Same seed, same bits"."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import FlopCounterMode

from pipejob.trainer.pipeline.balance import (
    Prediction,
    UnitCosts,
    as_input,
    forward_backward,
    predict,
)
from pipejob.trainer.workloads.batch_values import ForwardKwargs, tensors

# FLOPs a byte moved counts as. FlopCounterMode counts only matmuls, convolutions and
# attention, so a norm, an activation or a pooling layer would cost nothing and the split
# would pile them onto one stage; what they cost is their memory traffic. A CPU core or a
# GPU computes some 5 to 20 FLOPs in the time it moves one byte (its roofline's ridge):
# the low end, so that where a layer has matmuls their FLOPs still decide.
FLOPS_PER_BYTE = 4

# What one micro-batch costs a stage beyond its layers' counted work, in the count's units:
# the calls, sends and schedule's Python a micro-batch takes, and the worse use a smaller
# micro-batch makes of the cores. Fitted as t(b) = a*b + c to ResNet-50's timed costs per
# micro-batch of b = 2..16 images at 64x64 on 2 CPU cores (auto's own table): c is the time
# of 2.7 images' work, which count 2.9e9 on the slower stage. Counted, not timed: the same
# on every machine (where a GPU's fixed cost per call is larger, auto chooses more than a
# timed one would).
MICRO_BATCH_OVERHEAD = 3e9


def count_chain(
    pieces: list[nn.Module],
    names: list[str],
    values: tuple[Any, ...],
    first: bool,
    on_copies: bool = True,
) -> tuple[UnitCosts, tuple[Any, ...]]:
    """What each of a run of consecutive pieces costs for forward + backward on `values`,
    as balance.measure_chain says it (the same arguments, the same result), but counted:
    each piece's FLOPs plus FLOPS_PER_BYTE x the bytes of its inputs and outputs, which a
    forward reads and writes and a backward writes and reads as gradients (x 2). The same
    shapes give the same counts, on any machine, under any load."""
    if on_copies:
        pieces = copy.deepcopy(pieces)
    costs: list[float] = []
    passes_tensors: list[bool] = []
    for i, (name, piece) in enumerate(zip(names, pieces, strict=True)):
        inputs = tuple(as_input(v, i > 0 or not first) for v in values)
        with FlopCounterMode(display=False) as counter:
            outs = forward_backward(piece, inputs, name, i == 0 and first)
        moved = 2 * (nbytes(inputs) + nbytes(outs))
        costs.append(float(counter.get_total_flops() + FLOPS_PER_BYTE * moved))
        passes_tensors.append(all(isinstance(v, torch.Tensor) for v in outs))
        values = outs
    passed = tree_map_only(torch.Tensor, torch.Tensor.detach, values)
    return UnitCosts(costs, list(costs), passes_tensors=passes_tensors, counted=True), passed


def count_call(module: nn.Module, args: tuple[Any, ...], kwargs: ForwardKwargs) -> float:
    """What one call of `module` on `args` and `kwargs` costs, counted as count_chain counts
    a piece (the eager path's placement under spec.deterministic: a module the forward calls
    with keyword arguments, its outputs anything): forward + backward FLOPs plus
    FLOPS_PER_BYTE x the bytes of its inputs and outputs, twice. Every floating input gets a
    gradient, as a value from the master's glue does; `module`'s own gradients are dropped
    after (give it a copy to keep its statistics too)."""
    args, kwargs = as_input(args, True), as_input(kwargs, True)
    with torch.enable_grad(), FlopCounterMode(display=False) as counter:
        out = module(*args, **kwargs)
        grown = [t for t in tensors(out) if t.requires_grad]
        if grown:  # a frozen module on data that needs no gradient has no backward
            torch.autograd.backward([t.sum() for t in grown])
    module.zero_grad(set_to_none=True)
    moved = 2 * (nbytes([args, kwargs]) + nbytes([out]))
    return float(counter.get_total_flops() + FLOPS_PER_BYTE * moved)


def nbytes(values: Sequence[Any]) -> int:
    """The bytes of every tensor in `values` (inside tuples, lists and dicts too)."""
    return sum(t.numel() * t.element_size() for t in tensors(values))


def predict_counted(
    costs: UnitCosts,
    stages: int,
    micro_batches: int,
    batch: int,
    ranges: list[range] | None = None,
    per_process: int = 1,
    starts: Sequence[bool] | None = None,
) -> Prediction:
    """`microBatches: auto`'s prediction for `micro_batches` under spec.deterministic, from
    `costs` counted at its micro-batch size (count_chain): the schedule's slots,
    m x per_process + stages - 1, each of the slowest piece's count plus
    MICRO_BATCH_OVERHEAD. No clock and no cores (those differ between machines): one
    manifest's counts give one answer everywhere; balance.fastest picks from them."""
    return predict(
        costs, stages, micro_batches, batch, (), ranges, per_process, starts, MICRO_BATCH_OVERHEAD
    )
