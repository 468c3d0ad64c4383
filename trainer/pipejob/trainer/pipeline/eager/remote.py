"""The master's side of a module that lives on a stage on the eager path: a stand-in in the
model's tree that sends each call (its positional and keyword arguments, whatever they hold)
to the stage over RPC, inside the calling micro-batch's distributed autograd context, and the
calls the master makes of a stage's `Held`."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from pipejob.core.averaged import Ema
from pipejob.trainer.pipeline.eager.held import Held
from pipejob.trainer.runtime.checkpoint_format import FileEntry, ListedFile
from pipejob.trainer.workloads.batch_values import ForwardKwargs, dressed, undressed

# The micro-batch the calling thread computes: its number (across steps), its round's
# first, its replica, and how often it has called each module so far.
_local = threading.local()


def begin(number: int, first: int, replica: int) -> None:
    """The calling thread computes micro-batch `number` of the round beginning at `first`,
    on replica `replica`'s stages."""
    _local.turn = number, first
    _local.replica = replica
    _local.calls = {}


def _turn(name: str) -> tuple[int, int, int]:
    number, first = getattr(_local, "turn", (0, 0))
    calls = getattr(_local, "calls", None)
    if calls is None:  # a forward outside a step (evaluation): one micro-batch at a time
        calls = _local.calls = {}
    nth = calls.get(name, 0)
    calls[name] = nth + 1
    return number, first, nth


class OnStage(nn.Module):
    """Module `name` of the model, held by a stage of every replica: `places`, per replica,
    its worker and its `Held`; a call goes to the calling micro-batch's replica's (replica
    0's outside a step: evaluation)."""

    def __init__(self, name: str, places: list[tuple[str, rpc.RRef]]):
        super().__init__()
        self.module_name, self.places = name, places

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        turn = _turn(self.module_name)
        worker, held = self.places[getattr(_local, "replica", 0)]
        # A tensor subclass (MONAI's MetaTensor) crosses as its data, which torch's RPC
        # links into distributed autograd (inline, the stage's gradient never came back).
        sent = undressed(args), undressed(kwargs)
        return dressed(rpc.rpc_sync(worker, _call, args=(held, self.module_name, turn, *sent)))

    def extra_repr(self) -> str:
        return f"{self.module_name} on {', '.join(w for w, _ in self.places)}"


def _call(
    held: rpc.RRef,
    name: str,
    turn: tuple[int, int, int],
    args: tuple[Any, ...],
    kwargs: ForwardKwargs,
) -> Any:
    return undressed(held.local_value().call(name, turn, dressed(args), dressed(kwargs)))


def ended(held: rpc.RRef, number: int) -> None:
    held.local_value().ended(number)


def sum_gradients(held: rpc.RRef, contexts: list[int], unscale: float = 1.0) -> float:
    return held.local_value().sum_gradients(contexts, unscale)


def step(held: rpc.RRef, coefficient: float, lr: float) -> None:
    held.local_value().step(coefficient, lr)


def state(held: rpc.RRef) -> dict[str, torch.Tensor]:
    return held.local_value().state()


def gradient_state(held: rpc.RRef) -> dict[str, torch.Tensor]:
    return held.local_value().gradient_state()


def save(held: rpc.RRef, directory: str, name: str) -> FileEntry:
    return held.local_value().save(directory, name)


def load(held: rpc.RRef, directory: str, entries: list[ListedFile]) -> None:
    held.local_value().load(directory, entries)


def fingerprint(held: rpc.RRef) -> torch.Tensor:
    return held.local_value().fingerprint()


def keep_average(held: rpc.RRef, settings: Ema) -> None:
    held.local_value().keep_average(settings)


def swap_average(held: rpc.RRef) -> None:
    held.local_value().swap_average()


def state_names(held: rpc.RRef) -> list[str]:
    return held.local_value().state_names()


def set_training(held: rpc.RRef, training: bool) -> None:
    held.local_value().set_training(training)


def hold(worker: str, *args: Any) -> rpc.RRef:
    """A `Held` built on `worker` with `args` (its spec, module names, device, replicas)."""
    return rpc.remote(worker, Held, args=args)
