"""The user's model built with only some of its parameters in memory, the rest on the meta
device: the master plans the cut on a model none of whose parameters exist, and each stage
process builds it again keeping only its own (named by the order the factory makes them),
with the values a plain build gives them wherever the cut falls (workloads/standins.py).
How and at what cost: docs/architecture.md, "A model built in part"."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from pipejob.trainer.runtime import tuning
from pipejob.trainer.workloads.op_effects import meta_like
from pipejob.trainer.workloads.standins import Placeholder, Standins


class Registrations:
    """The parameters a factory made, numbered in order, and the number each slot (module
    and attribute) was given last: a slot keeps its name when its parameter is replaced (a
    dtype conversion, a placeholder settled), and a tie fills a second one. And what the
    build noted of values read from placeholders (see `Standins`)."""

    def __init__(self) -> None:
        self.params: list[nn.Parameter] = []  # kept alive, so their ids stay theirs
        self.number: dict[int, int] = {}  # id(parameter) -> its number
        self.slots: dict[tuple[int, str], tuple[nn.Module, str, int]] = {}
        self.needs: dict[int, frozenset[int]] = {}  # number -> the numbers its value needs
        self.buffers: dict[str, frozenset[int]] = {}  # a buffer's name -> the numbers it needs
        self.everywhere: set[int] = set()  # numbers whose values steered the build

    def add(self, param: nn.Parameter) -> int:
        if id(param) not in self.number:
            self.number[id(param)] = len(self.params)
            self.params.append(param)
        return self.number[id(param)]

    def note(self, module: nn.Module, name: str, param: nn.Parameter) -> None:
        """Record `param` in `module.name`, numbering it if it is new."""
        self.slots[id(module), name] = (module, name, self.add(param))


class Numbering(list[list[str]]):
    """Per registration number, the names the model holds that parameter under (none when
    it was replaced, several when tied); and, from the build, which parameters each one's
    value (`needs`), each buffer's (`buffers`) and the build itself (`everywhere`) were
    computed from."""

    def __init__(self, names: list[list[str]], registered: Registrations):
        super().__init__(names)
        self.needs = registered.needs
        self.buffers = registered.buffers
        self.everywhere = frozenset(registered.everywhere)


def build(
    factory: Callable[[], nn.Module],
    keep: Collection[int] | None,
) -> tuple[nn.Module, Registrations]:
    """`factory()` with the parameters made `keep`-th (counting from 0) in memory and
    every other on the meta device; `keep` None keeps all (a plain build). Also returns
    what was made, which is how `numbering` names each number."""
    registered = Registrations()
    if keep is None:
        with _registrations(registered, None):
            return factory(), registered
    building = Standins(registered, set(keep))
    with tuning.returning_memory(), _registrations(registered, building):
        model = factory()
        for module in model.modules():  # slots filled other than by registering (deep copies)
            for name, param in module._parameters.items():
                if param is not None and id(param) in registered.number:
                    registered.slots.setdefault(
                        (id(module), name), (module, name, registered.number[id(param)])
                    )
        building.finish(model)
    _settle(model, registered, set(keep))
    return model, registered


# The class attributes a build replaces, as torch defines them.
_REGISTER = nn.Module.register_parameter
_DEEPCOPY = nn.Parameter.__deepcopy__
# This thread's builds, innermost last: each a (register, copied) pair (`_registrations`).
_BUILDS = threading.local()
_INSTALLED = threading.Lock()  # guards `_building`, the threads building now
_building = 0


def _this_threads_build() -> tuple[Callable[..., None], Callable[..., nn.Parameter]] | None:
    stack = getattr(_BUILDS, "stack", None)
    return stack[-1] if stack else None


def _register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    """nn.Module.register_parameter while any thread builds: that thread's build's, torch's
    own in every other thread."""
    build = _this_threads_build()
    if build is None:
        return _REGISTER(module, name, param)
    return build[0](module, name, param)


def _deepcopy_parameter(param: nn.Parameter, memo: dict[int, Any]) -> nn.Parameter:
    """nn.Parameter.__deepcopy__ while any thread builds (as `_register_parameter`)."""
    build = _this_threads_build()
    return _DEEPCOPY(param, memo) if build is None else build[1](param, memo)


@contextmanager
def _installed() -> Iterator[None]:
    """torch's classes dispatch to the calling thread's build from the first thread's build
    to the last one's end; outside any build they are torch's own again."""
    global _building
    with _INSTALLED:
        if _building == 0:
            nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign]
            nn.Parameter.__deepcopy__ = _deepcopy_parameter  # type: ignore[method-assign]
        _building += 1
    try:
        yield
    finally:
        with _INSTALLED:
            _building -= 1
            if _building == 0:
                nn.Module.register_parameter = _REGISTER  # type: ignore[method-assign]
                nn.Parameter.__deepcopy__ = _DEEPCOPY  # type: ignore[method-assign]


@contextmanager
def _registrations(registered: Registrations, building: Standins | None) -> Iterator[None]:
    """While the factory runs in this thread, each parameter it makes for the first time
    (registered, or deep copied) is numbered and, unless `building` keeps it, replaced by a
    placeholder. Another thread, building or not, never sees this build's hooks."""
    replaced = WeakIdKeyDictionary()

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param in replaced:
            param = replaced[param]
        if param is not None and building is not None and id(param) not in registered.number:
            made = building.made(param)
            if made is not param:
                replaced[param] = made
                param = made
        _REGISTER(module, name, param)
        if param is not None:
            registered.note(module, name, param)

    def copied(param: nn.Parameter, memo: dict[int, Any]) -> nn.Parameter:
        if id(param) in memo:
            return memo[id(param)]
        made = building.copied(param) if building is not None else _DEEPCOPY(param, memo)
        memo[id(param)] = made
        return made

    stack = _BUILDS.__dict__.setdefault("stack", [])
    stack.append((register, copied))
    try:
        with _installed():
            if building is None:
                yield
            else:
                with building:
                    yield
    finally:
        stack.pop()


def _settle(model: nn.Module, registered: Registrations, keep: set[int]) -> None:
    """The placeholders as plain meta parameters once the factory is done (a tensor that
    says it is not meta would mislead whatever reads it later), and a parameter made real
    though not kept (a lazy one, materialized by the factory's dry run) put there too; ties
    stay ties."""
    plain: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            number = registered.number.get(id(param))
            real = not isinstance(param, Placeholder) and param.device.type != "meta"
            if isinstance(param, Placeholder) or (
                real and number is not None and number not in keep
            ):
                if id(param) not in plain:
                    plain[id(param)] = nn.Parameter(meta_like(param), param.requires_grad)
                module._parameters[name] = plain[id(param)]


def numbering(model: nn.Module, registered: Registrations) -> Numbering:
    """Per registration number, the names the model holds that parameter under, through
    the slots that number filled last (none when it was replaced, several when tied), with
    what each value was computed from (`Numbering`)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    numbered: list[set[str]] = [set() for _ in registered.params]
    for module, attr, number in registered.slots.values():
        param = module._parameters.get(attr)
        if param is not None:
            numbered[number].update(names.get(id(param), []))
    return Numbering([sorted(held) for held in numbered], registered)


def numbers(numbered: list[list[str]], wanted: Collection[str]) -> list[int]:
    """The registration numbers of the parameters held under any of the `wanted` names (of
    parameters or buffers), and of every parameter their values are computed from: a
    process keeping these builds the wanted ones exactly."""
    wanted = set(wanted)
    found = {i for i, held in enumerate(numbered) if wanted.intersection(held)}
    if isinstance(numbered, Numbering):
        found |= numbered.everywhere
        for name in wanted:
            found |= numbered.buffers.get(name, frozenset())
        todo = list(found)
        while todo:
            for source in numbered.needs.get(todo.pop(), frozenset()):
                if source >= 0 and source not in found:
                    found.add(source)
                    todo.append(source)
    return sorted(found)
