"""The RPC calls a process makes and serves, counted, so the watchdog (runtime/watchdog.py) can
tell a stuck world from a busy one, and the master's oldest outstanding call says whom it
waits on. Why and how: docs/architecture.md ("The watchdog")."""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Call:
    """A call the master made that has not ended yet."""

    to: tuple[str, ...]  # the members called (the backward: every member it reaches)
    what: str  # "on_stage forward", "train", "the distributed backward"
    since: float  # time.monotonic() when it was made


class Ledger:
    """One process's calls: how many have ended (made or served) and which are open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended = 0
        self._open: dict[int, Call] = {}
        self._tokens = itertools.count()

    def begin(self, to: tuple[str, ...], what: str) -> int:
        token = next(self._tokens)
        with self._lock:
            self._open[token] = Call(to, what, time.monotonic())
        return token

    def end(self, token: int | None = None) -> None:
        """A call ended (`token` from `begin`), or, without a token, one this process served."""
        with self._lock:
            self._ended += 1
            if token is not None:
                self._open.pop(token, None)

    def ended(self) -> int:
        with self._lock:
            return self._ended

    def outstanding(self) -> list[Call]:
        """The calls still open, oldest first."""
        with self._lock:
            return sorted(self._open.values(), key=lambda call: call.since)


# This process's ledger.
LEDGER = Ledger()


def served() -> None:
    """A call this process served has ended (returned or raised)."""
    LEDGER.end()


def _name(to: Any) -> str:
    """A call's destination as a member's name: torch takes a name, a WorkerInfo or a rank."""
    return to if isinstance(to, str) else str(getattr(to, "name", to))


def _call_text(func: Any, args: Any) -> str:
    """The function called, with its first string argument when it has one (the name of the
    Stage method that `on_stage` runs, as pipeline/stage_calls.py sends it: "on_stage
    forward")."""
    name = getattr(func, "__name__", None) or type(func).__name__
    method = next((a for a in (args or ())[:2] if isinstance(a, str)), None)
    return f"{name} {method}" if method else name


def _traced(call: Callable[..., Any], *, blocks: bool, remote: bool = False) -> Callable[..., Any]:
    @functools.wraps(call)
    def traced(to: Any, func: Any, args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        token = LEDGER.begin((_name(to),), _call_text(func, args))
        try:
            result = call(to, func, args, *rest, **kwargs)
        except BaseException:
            LEDGER.end(token)
            raise
        if blocks:
            LEDGER.end(token)
            return result
        try:  # a Future, or an RRef whose creation ends later
            future = result._get_future() if remote else result
            future.add_done_callback(lambda _: LEDGER.end(token))
        except RuntimeError:  # an RRef this process owns: created already
            LEDGER.end(token)
        return result

    traced.traced = True  # type: ignore[attr-defined]
    return traced


def trace(members: list[str]) -> None:
    """Count and keep every call this process makes from now on (the master's: whom it waits
    on; a member's: what its heartbeats say it waits on); `members` are the ones a
    distributed backward may reach. Idempotent."""
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    if getattr(rpc.rpc_async, "traced", False):
        return
    rpc.rpc_async = _traced(rpc.rpc_async, blocks=False)
    rpc.rpc_sync = _traced(rpc.rpc_sync, blocks=True)
    rpc.remote = _traced(rpc.remote, blocks=False, remote=True)
    backward = dist_autograd.backward

    @functools.wraps(backward)
    def traced_backward(*args: Any, **kwargs: Any) -> Any:
        token = LEDGER.begin(tuple(members), "the distributed backward")
        try:
            return backward(*args, **kwargs)
        finally:
            LEDGER.end(token)

    dist_autograd.backward = traced_backward
