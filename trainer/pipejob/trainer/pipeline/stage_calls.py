"""How the master calls a stage process's objects: a method of the Stage an RRef holds, or of
the first stage's Reader, named by the method itself (`on_stage_async(name, stage,
Shard.save, directory, file)`), so a misspelt call fails where it is written and in a type
checker. Why the calls go through a function of this module, not the RRef's proxy: `on_stage`.
More in docs/architecture.md ("Stage calls")."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef

if TYPE_CHECKING:
    from pipejob.trainer.pipeline.reader import Reader
    from pipejob.trainer.pipeline.shard import Shard

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound="Shard")


def on_stage(stage: RRef, method: str, *args: Any, **kwargs: Any) -> Any:
    """Runs on the stage's worker: call method `method` of the Stage object held there (on a
    GPU, settled: the rpc engine's forward settles the device itself, once a round).

    Every call of the master's to a Stage goes through this function rather than the RRef's
    proxy (`rref.rpc_async().forward`): a proxy's first call is sent from a callback thread
    once it has fetched the RRef's type, outside the distributed autograd context, which
    silently drops that micro-batch's gradients. The method travels as its name, which the
    watchdog and the profiler show beside `on_stage` (runtime/calls.py)."""
    held = stage.local_value()
    if method == "forward":
        return held.forward(*args, **kwargs)
    with held.settled():
        return getattr(held, method)(*args, **kwargs)


def on_reader(stage: RRef, method: str, *args: Any, **kwargs: Any) -> Any:
    """Runs on a first stage's worker: call method `method` of its Reader (the rounds' data)."""
    return getattr(stage.local_value().reader, method)(*args, **kwargs)


def on_stage_async(
    name: str,
    stage: RRef,
    method: Callable[Concatenate[S, P], R],
    *args: P.args,
    **kwargs: P.kwargs,
) -> torch.futures.Future[R]:
    """The future of `method` of the Stage `stage` holds on worker `name` (rpc_async)."""
    return rpc.rpc_async(name, on_stage, args=(stage, method.__name__, *args), kwargs=kwargs)


def on_stage_sync(
    name: str,
    stage: RRef,
    method: Callable[Concatenate[S, P], R],
    *args: P.args,
    **kwargs: P.kwargs,
) -> R:
    """What `method` of the Stage `stage` holds on worker `name` returns (rpc_sync)."""
    return rpc.rpc_sync(name, on_stage, args=(stage, method.__name__, *args), kwargs=kwargs)


def on_stage_remote(
    name: str,
    stage: RRef,
    method: Callable[Concatenate[S, P], R],
    *args: P.args,
    **kwargs: P.kwargs,
) -> RRef[R]:
    """An RRef, owned by worker `name`, to what `method` of the Stage `stage` holds there
    returns (rpc.remote)."""
    return rpc.remote(name, on_stage, args=(stage, method.__name__, *args), kwargs=kwargs)


def on_reader_async(
    name: str,
    stage: RRef,
    method: Callable[Concatenate[Reader, P], R],
    *args: P.args,
    **kwargs: P.kwargs,
) -> torch.futures.Future[R]:
    """The future of `method` of the Reader of the first stage `stage` (rpc_async)."""
    return rpc.rpc_async(name, on_reader, args=(stage, method.__name__, *args), kwargs=kwargs)


def on_reader_sync(
    name: str,
    stage: RRef,
    method: Callable[Concatenate[Reader, P], R],
    *args: P.args,
    **kwargs: P.kwargs,
) -> R:
    """What `method` of the Reader of the first stage `stage` returns (rpc_sync)."""
    return rpc.rpc_sync(name, on_reader, args=(stage, method.__name__, *args), kwargs=kwargs)


def on_reader_remote(
    name: str,
    stage: RRef,
    method: Callable[Concatenate[Reader, P], R],
    *args: P.args,
    **kwargs: P.kwargs,
) -> RRef[R]:
    """An RRef, owned by worker `name`, to what `method` of the Reader of the first stage
    `stage` returns (rpc.remote)."""
    return rpc.remote(name, on_reader, args=(stage, method.__name__, *args), kwargs=kwargs)


def on_every_stage(
    names: list[str],
    stages: list[RRef],
    method: Callable[Concatenate[S, P], R],
    *args: P.args,
    **kwargs: P.kwargs,
) -> list[R]:
    """What `method` of every Stage (`stages`, on workers `names`), called at once, returns."""
    return torch.futures.wait_all(
        [
            on_stage_async(name, stage, method, *args, **kwargs)
            for name, stage in zip(names, stages, strict=True)
        ]
    )
