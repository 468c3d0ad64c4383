"""How the master calls a stage process's objects: a method of a Stage (named by its StageRef,
which carries its worker), or of the first stage's Reader, named by the method itself
(`remote_stage(stage).future(StageBase.save, directory, file)`), so a misspelt call fails
where it is written and in a type checker. Why the calls go through a function of this
module, not the RRef's proxy: `on_stage`. More in docs/architecture.md ("Stage calls")."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef
from torch.futures import Future

P = ParamSpec("P")
R = TypeVar("R")
# A method of a Stage (or a Reader) as its class holds it: the object, then its arguments.
Method = Callable[Concatenate[Any, P], R]
# The stages made in this process, by key (StageRef); keys come from the master, which makes
# every stage of its world.
_HERE: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class StageRef:
    """A Stage made on worker `name`, as its callers name it: by `key`, which its process
    knows it by and is all a call to it carries (`Remote`; an RRef in a call costs its sender
    and its owner the RRef protocol's messages: 0.35 CPU-ms a call, measured on 2 cores);
    and, in the process that made it (the master), by its RRef, which keeps it alive there.
    It travels (to the stages that call each other) as its name and key."""

    def __init__(self, name: str, key: int, rref: RRef | None = None):
        self.name, self.key, self.rref = name, key, rref

    def __reduce__(self) -> tuple[Any, ...]:
        return StageRef, (self.name, self.key)  # travels without its RRef

    def local_value(self) -> Any:
        """The Stage itself, in the process that holds it."""
        return held(self.key)


def held(key: int) -> Any:
    """The Stage this process holds by `key` (StageRef.key)."""
    stage = _HERE.get(key)
    if stage is None:
        raise LookupError(f"stage {key} is not held in this process")
    return stage


def on_stage(key: int, method: str, *args: Any, **kwargs: Any) -> Any:
    """Runs on the stage's worker: call method `method` of the Stage object held there (on a
    GPU, settled: the rpc engine's forward settles the device itself, once a round).

    Every call of the master's to a Stage goes through this function rather than the RRef's
    proxy (`rref.rpc_async().forward`): a proxy's first call is sent from a callback thread
    once it has fetched the RRef's type, outside the distributed autograd context, which
    silently drops that micro-batch's gradients. The method travels as its name, which the
    watchdog and the profiler show beside `on_stage` (runtime/rpc_ledger.py)."""
    stage = held(key)
    if method == "forward":
        return stage.forward(*args, **kwargs)
    with stage.settled():
        return getattr(stage, method)(*args, **kwargs)


def on_reader(key: int, method: str, *args: Any, **kwargs: Any) -> Any:
    """Runs on a first stage's worker: call method `method` of its Reader (the rounds' data)."""
    return getattr(held(key).reader, method)(*args, **kwargs)


class Remote:
    """A Stage (`stage`), or its Reader, as the master calls it: on its worker, through
    `function` (`on_stage` or `on_reader`), with its key and the method's name."""

    def __init__(self, function: Callable[..., Any], stage: StageRef):
        self.function, self.stage = function, stage

    def future(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """The future of `method`'s result, called there (rpc_async)."""
        call = (self.stage.key, method.__name__, *args)
        return rpc.rpc_async(self.stage.name, self.function, args=call, kwargs=kwargs)

    def result(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`method`'s result, called there, once it returns (rpc_sync)."""
        call = (self.stage.key, method.__name__, *args)
        return rpc.rpc_sync(self.stage.name, self.function, args=call, kwargs=kwargs)

    def rref(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> RRef[R]:
        """An RRef to `method`'s result, which stays there (rpc.remote)."""
        call = (self.stage.key, method.__name__, *args)
        return rpc.remote(self.stage.name, self.function, args=call, kwargs=kwargs)


def created_stages(
    names: list[str], stage: Callable[..., Any], args: list[tuple[Any, ...]]
) -> list[StageRef]:
    """A new `stage(*args[k])` on each worker `names[k]`, held there (rpc.remote), once made."""
    made = [
        StageRef(name, next(_KEYS), rpc.remote(name, stage, args=a))
        for name, a in zip(names, args, strict=True)
    ]
    torch.futures.wait_all([rpc.rpc_async(s.name, _keep, args=(s.key, s.rref)) for s in made])
    return made


def _keep(key: int, made: RRef) -> None:
    """Runs on a stage's worker: the Stage `made` holds (once made; its error if that
    failed), known by `key` from now on."""
    _HERE[key] = made.local_value()


def remote_stage(stage: StageRef) -> Remote:
    """The Stage `stage` names, to call its methods."""
    return Remote(on_stage, stage)


def remote_reader(stage: StageRef) -> Remote:
    """The Reader of the first stage `stage`, to call its methods."""
    return Remote(on_reader, stage)


def every_stage_result(
    stages: list[StageRef], method: Method[P, R], *args: P.args, **kwargs: P.kwargs
) -> list[R]:
    """What `method` of every Stage `stages` names, called at once, returns."""
    return torch.futures.wait_all(
        [remote_stage(stage).future(method, *args, **kwargs) for stage in stages]
    )
