"""Each stage process builds its own part of the model from a `PieceBuilder` (the user's factory,
keeping only its own parameters), and measures the cut's costs the same way, on what the
stages before it pass on. How and why: docs/architecture.md, "Where a PipelineJob's model
and data live" (steps 2 and 3)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.utils._pytree import tree_map_only

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline.balance import UnitCosts, measure_chain, min_max_partition
from pipejob.trainer.pipeline.counted_cost import count_chain
from pipejob.trainer.runtime import tuning
from pipejob.trainer.workloads import batch_values, cut, data, materialize, models, staged

# The automatic cut opens modules until it has this many candidates per stage (where the
# module tree has them): enough for the measured min-max split to balance.
CANDIDATES_PER_STAGE = 2


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def trace(spec: PipelineSpec, model: nn.Module) -> cut.Traced | staged.Layers | staged.Built:
    """The model's cut candidates, found the same way in every process: traced, or as the
    user stages it (spec.model.staged)."""
    if spec.model.staged is not None:
        return staged.as_traced(spec, model)
    # The data's shapes, read only where fx's plain trace does not do (workloads/shapes.py).
    return cut.Traced(
        model,
        CANDIDATES_PER_STAGE * spec.pieces,
        spec.split_points,
        sample=lambda: data.sample(spec, 2)[0],
    )


@dataclass(frozen=True)
class PieceBuilder:
    """How a process builds some consecutive pieces of the model (the model cut where
    `starts` say), keeping in memory only the parameters registered `keep`-th: the job's
    factory under spec.seed, in the default dtype the master had (`dtype`)."""

    spec: PipelineSpec
    dtype: torch.dtype
    keep: tuple[int, ...]
    starts: tuple[str, ...]  # the units where the pieces after the first begin
    pieces: tuple[int, ...]  # which pieces this process builds

    def build(self) -> list[nn.Module]:
        # The process's own random stream stays as it was (dropout draws from it).
        with torch.random.fork_rng(devices=[]), default_dtype(self.dtype):
            if staged.builds(self.spec):  # the user's function builds each piece alone
                return staged.build(self.spec, self.pieces)
            model, _ = materialize.build(lambda: models.build(self.spec), self.keep)
        with default_dtype(self.dtype):  # traced with the master's shapes and dtypes
            modules = trace(self.spec, model).split(list(self.starts))
        built = [modules[i] for i in self.pieces]
        missing = [n for m in built for n, p in m.named_parameters() if p.device.type == "meta"]
        if missing:
            raise RuntimeError(
                f"parameters {', '.join(missing[:3])} were not built here: the model's factory"
                " registered its parameters in another order than on the master"
            )
        return built


def measure_here(
    builder: PieceBuilder, units: list[str], given: list[tuple[Any, ...]] | None, sizes: list[int]
) -> tuple[list[UnitCosts], list[tuple[Any, ...]]] | str:
    """Runs on a stage: builds `builder`'s pieces (one per unit of `units`) and measures them
    on micro-batches of each of `sizes`: `given`, what the pieces before pass on, or on the
    first stage (None) micro-batches of the first training batch, read here. The costs and
    what the last piece passes on, or a message when the data does not fit the model."""
    # Measured where the stage computes: a GPU stage's costs are its GPU's, not its cores'.
    device = torch.device("cuda:0" if builder.spec.gpus_per_stage > 0 else "cpu")
    # What is built to be measured is freed before the stage builds its shard, and given back.
    with tuning.returning_memory():
        first = given is None
        if first:
            with default_dtype(builder.dtype):  # the data as the master's default dtype makes it
                inputs, _ = data.sample(builder.spec, builder.spec.batch_size)
            given = [(batch_values.take(inputs, size),) for size in sizes]  # a dict's too
        pieces = [piece.to(device) for piece in builder.build()]  # no copies: the stage's own
        try:
            with torch.random.fork_rng(devices=[]):  # dropout here leaves training's draws be
                # spec.deterministic: counted, so a busy machine cuts where an idle one does.
                chain = count_chain if builder.spec.deterministic else measure_chain
                measured = [
                    chain(pieces, units, _to(values, device), first, on_copies=False)
                    for values in given
                ]
        except ValueError as e:
            return str(e)
        finally:
            del pieces
            gc.collect()  # graph modules hold cycles
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the stage's shard, not these, gets the GPU
    cpu = torch.device("cpu")  # what the next stage measures on passes through the master
    return [c for c, _ in measured], [_to(v, cpu) for _, v in measured]


def _to(values: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
    return tree_map_only(torch.Tensor, lambda v: v.to(device), values)


def measure_on_stages(
    names: list[str],
    spec: PipelineSpec,
    traced: cut.Traced,
    numbered: materialize.Numbering,
    batches: list[int],
) -> list[UnitCosts]:
    """Every unit's cost on a micro-batch of each size of `batches`, measured on stage
    processes `names` (one pipeline's), each building a run of units of about equal
    parameter bytes; the first reads the samples."""
    units = traced.units
    pieces = traced.split(units[1:])  # on the meta device: sizes only
    sizes = [
        float(sum(p.numel() * p.element_size() for p in piece.parameters())) for piece in pieces
    ]
    runs = min_max_partition(sizes, min(len(names), len(units)))
    dtype = torch.get_default_dtype()
    values: list[tuple[Any, ...]] | None = None  # the first stage reads its samples
    seconds: list[list[float]] = [[] for _ in batches]
    cpu: list[list[float]] = [[] for _ in batches]
    tensors: list[list[bool]] = [[] for _ in batches]
    for k, run in enumerate(runs):
        held = [n for i in run for n in cut.state_names(pieces[i])]
        builder = PieceBuilder(
            spec, dtype, tuple(materialize.numbers(numbered, held)), tuple(units[1:]), tuple(run)
        )
        got = rpc.rpc_sync(
            names[k], measure_here, args=(builder, [units[i] for i in run], values, batches)
        )
        if isinstance(got, str):
            raise ValueError(got)
        costs, values = got
        for j, c in enumerate(costs):
            seconds[j] += c.seconds
            cpu[j] += c.cpu_seconds
            tensors[j] += c.passes_tensors or [True] * len(c.seconds)
    counted = spec.deterministic
    return [
        UnitCosts(s, c, sizes, t, counted) for s, c, t in zip(seconds, cpu, tensors, strict=True)
    ]
