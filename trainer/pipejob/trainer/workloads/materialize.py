"""The user's model built with only some of its parameters in memory: the rest live on the
meta device (a shape and a dtype, no storage). The master plans the cut on a model none of
whose parameters exist; each stage process builds the model again keeping only its own.

Which parameters to keep is said by their place in the order the factory registers them
(`nn.Module.register_parameter`, which assigning a Parameter to a module calls): the same
factory with the same arguments registers the same parameters in the same order in every
process, so the master, having built the model once, can name each stage's by number.

The kept parameters get exactly the values a plain build gives them, wherever the cut falls:
every other parameter is still initialised, on a scratch tensor standing in for it (one at a
time), so the random stream advances as in a plain build (the factory runs under
`spec.seed`), even through initialisations that draw until their values fit. The cost: each
process computes the whole model's initialisation, and holds its own parameters, the
buffers (small) and one stand-in at a time. An initialisation that reaches a parameter not
kept only through `.data` (a plain meta tensor, which torch.nn.init skips) draws nothing
for it where it is not kept."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_any, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from pipejob.trainer.runtime import tuning

META = torch.device("meta")


class _Placeholder(nn.Parameter):
    """A parameter not kept, while the factory runs: on the meta device, but reporting
    `is_meta` False, so that torch.nn.init initialises it (see _Scratch)."""

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        return False


class _Scratch(TorchDispatchMode):
    """While the factory runs: operations on a placeholder run on a scratch tensor of its
    shape standing in for it (initialisations that draw until their values fit, like
    trunc_normal_, read what they drew), one placeholder's at a time; and any other random
    operation on a meta tensor runs again on a scratch tensor. So the random stream advances
    as a plain build's does."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo's `disable` unless the mode says
        # otherwise (the opt-out its TorchDispatchMode documents), which imports torch._dynamo
        # and inductor into every process that builds a model: 100 MB of a stage's memory.
        # Nothing here runs under torch.compile.
        return False

    def __init__(self) -> None:
        super().__init__()
        self._for: _Placeholder | None = None  # whose stand-in `_stand_in` is
        self._stand_in: torch.Tensor | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], _Placeholder):
            return func(*args, **kwargs)  # a conversion (`.double()`): still no memory
        if tree_any(lambda v: isinstance(v, _Placeholder), (args, kwargs)):
            result = func(*tree_map(self._standing_in, args),
                          **tree_map(self._standing_in, kwargs))  # fmt: skip
            return tree_map(lambda v: self._for if v is self._stand_in else v, result)
        if torch.Tag.nondeterministic_seeded in func.tags and tree_any(_is_meta, (args, kwargs)):
            func(*tree_map(_scratch, args), **tree_map(_scratch, kwargs))
        return func(*args, **kwargs)

    def _standing_in(self, value: Any) -> Any:
        if not isinstance(value, _Placeholder):
            return value
        if value is not self._for:  # the last placeholder's initialisation is over
            self._for, self._stand_in = value, _scratch(value)
        return self._stand_in


def _is_meta(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "meta"
    return isinstance(value, torch.device) and value.type == "meta"


def _scratch(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
    return torch.device("cpu") if _is_meta(value) else value


class Registrations:
    """The parameters a factory registered, numbered in order, and the number each slot
    (module and attribute) was given last: a slot keeps its name when its parameter is
    replaced (a dtype conversion, a placeholder settled), and a tie fills a second one."""

    def __init__(self) -> None:
        self.params: list[nn.Parameter] = []  # kept alive, so their ids stay theirs
        self.number: dict[int, int] = {}  # id(parameter) -> its number
        self.slots: dict[tuple[int, str], tuple[nn.Module, str, int]] = {}

    def note(self, module: nn.Module, name: str, param: nn.Parameter) -> None:
        """Record `param` in `module.name`, numbering it if it is new."""
        if id(param) not in self.number:
            self.number[id(param)] = len(self.params)
            self.params.append(param)
        self.slots[id(module), name] = (module, name, self.number[id(param)])


def build(factory: Callable[[], nn.Module], keep: Collection[int] | None,
          ) -> tuple[nn.Module, Registrations]:  # fmt: skip
    """`factory()` with the parameters registered `keep`-th (counting from 0) in memory and
    every other on the meta device; `keep` None keeps all (a plain build). Also returns
    what was registered, which is how `numbering` names each number."""
    registered = Registrations()
    if keep is None:
        with _registrations(registered, lambda index: True):
            return factory(), registered
    kept = set(keep)
    with tuning.returning_memory(), _registrations(registered, kept.__contains__), _Scratch():
        model = factory()
    _settle(model)
    return model, registered


@contextmanager
def _registrations(registered: Registrations, keeps: Callable[[int], bool]) -> Iterator[None]:
    """While the factory runs, each parameter registered for the first time is numbered and,
    unless `keeps(number)`, replaced by a placeholder on the meta device; registering one
    again (a tie) registers what replaced it."""
    original = nn.Module.register_parameter
    replaced = WeakIdKeyDictionary()

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param in replaced:
            param = replaced[param]
        if param is not None and id(param) not in registered.number:
            if not keeps(len(registered.params)) and param.device.type != "meta":
                placeholder = _Placeholder(param.detach().to(META), param.requires_grad)
                replaced[param] = placeholder
                param = placeholder
        original(module, name, param)
        if param is not None:
            registered.note(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _settle(model: nn.Module) -> None:
    """The placeholders as plain meta parameters once the factory is done (a tensor that
    says it is not meta would mislead whatever reads it later); ties stay ties."""
    plain: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, _Placeholder):
                if id(param) not in plain:
                    plain[id(param)] = nn.Parameter(param.detach(), param.requires_grad)
                module._parameters[name] = plain[id(param)]


def numbering(model: nn.Module, registered: Registrations) -> list[list[str]]:
    """Per registration number, the names the model holds that parameter under, through
    the slots that number filled last (none when it was replaced, several when tied)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    numbered: list[set[str]] = [set() for _ in registered.params]
    for module, attr, number in registered.slots.values():
        param = module._parameters.get(attr)
        if param is not None:
            numbered[number].update(names.get(id(param), []))
    return [sorted(held) for held in numbered]


def numbers(numbered: list[list[str]], wanted: Collection[str]) -> list[int]:
    """The registration numbers of the parameters held under any of the `wanted` names."""
    wanted = set(wanted)
    return [i for i, held in enumerate(numbered) if wanted.intersection(held)]
