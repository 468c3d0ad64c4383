"""The parameters a process does not keep, while the user's factory builds the model
(workloads/materialize.py): placeholders on the meta device, what the factory does to each
run on a scratch tensor standing in for it, one at a time, so the random stream advances as
in a plain build; a value lives only while its stand-in does, and values computed from a lost
one are followed (tainted with its number) into the parameters and buffers that then need it.
Torch's operations' effects: workloads/op_effects.py; the whole: docs/architecture.md."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from pipejob.trainer.workloads.op_effects import (
    AS_IS,
    INTO_PYTHON,
    META,
    OUT_OF_TORCH,
    OVERWRITES,
    SHAPES_ONLY,
    is_meta,
    is_whole,
    meta_like,
    written_arguments,
)

if TYPE_CHECKING:
    from pipejob.trainer.workloads.materialize import Registrations

aten = torch.ops.aten


class Placeholder(nn.Parameter):
    """A parameter not kept, while the factory runs: on the meta device, but reporting
    `is_meta` False and the device it was made on, so that torch.nn.init initialises it and
    tensors made beside it (`device=weight.device`) are real; `source` is the placeholder
    whose value it shares (a `Parameter(weight)` of a parametrization)."""

    made_on: torch.device
    source: Placeholder | None

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        return False

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.made_on

    def detach(self) -> Placeholder:  # type: ignore[override]
        return placeholder(self, self.made_on, False, source=self.root)

    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        """Its stand-in's (a plain tensor, as a parameter's `.data` is), while a build runs."""
        if _ACTIVE is None:
            return meta_like(self)
        return _ACTIVE.standing_in(self).detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if _ACTIVE is not None and value.device.type != "meta":  # its value, from now on
            torch._C.TensorBase.data.__set__(self, meta_like(value))  # type: ignore[attr-defined]
            _ACTIVE.assign(self, value)
        else:
            if _ACTIVE is not None:  # a conversion of it (`module.to(device)`, `.half()`)
                _ACTIVE.convert(self, value)
            torch._C.TensorBase.data.__set__(self, value)  # type: ignore[attr-defined]

    @property
    def root(self) -> Placeholder:
        return self if self.source is None else self.source


def placeholder(
    like: torch.Tensor, device: torch.device, requires_grad: bool, source: Placeholder | None = None
) -> Placeholder:
    made = Placeholder(meta_like(like), requires_grad)
    # What a library noted on the parameter, as on the parameter itself (Hugging Face marks
    # the weights it loaded `_is_hf_initialized`, and its initialisation then skips them).
    made.__dict__.update(getattr(like, "__dict__", {}))
    made.made_on, made.source = device, source
    return made


class Standins:
    """While the factory runs: what it does to a placeholder runs on a scratch tensor
    standing in for it, one placeholder's at a time (a new parameter's first stand-in is the
    tensor the factory made), swapped in where torch is called (`_Calls`, before any of
    torch's own code compares devices) and, for whatever reaches torch's operations with a
    placeholder still in it, there (`_Operations`); any other random operation on a meta
    tensor runs again on a scratch tensor, unless the factory made that tensor on the meta
    device itself (`from_pretrained` builds there and loads, drawing nothing). So the random
    stream advances as in a plain build.

    And it follows where values come from: every storage is tainted with the numbers of the
    parameters whose true values its values need. A placeholder's scratch stand-in, made
    once its value was lost, needs that parameter; writing a tensor whole replaces its taint
    with what was written; anything computed adds the taints it read. What a parameter's or
    buffer's final value is tainted with are the parameters it needs (`Registrations.needs`,
    `.buffers`); a tainted value read into Python (a branch) needs them everywhere."""

    def __init__(self, registered: Registrations, keep: set[int]) -> None:
        self.registered, self.keep = registered, keep
        self._for: Placeholder | None = None  # whose value `_stand_in` holds
        self._stand_in: torch.Tensor | None = None
        self._held: dict[int, frozenset[int]] = {}  # a placeholder's taint, off its stand-in
        self._taint = WeakIdKeyDictionary()  # a storage -> the numbers its values need
        self._own_meta = WeakIdKeyDictionary()  # meta storages the factory made: meta plainly too
        self._modes = (_Calls(self), _Operations(self))

    def __enter__(self) -> Standins:
        global _ACTIVE
        _ACTIVE = self
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        _ACTIVE = None

    # ---------------------------------------------------------------- parameters made

    def made(self, param: nn.Parameter) -> nn.Parameter:
        """A parameter registered for the first time: itself where kept, else a placeholder
        whose first stand-in is the parameter itself."""
        number = len(self.registered.params)
        if isinstance(param, Placeholder):  # a placeholder's alias: its value is the source's
            if number in self.keep:
                raise _unbuildable(param)
            self.registered.needs[number] = self.sources(param) | {self._number(param.root)}
            return param
        if number in self.keep or param.device.type == "meta" or _is_lazy(param):
            return param
        made = placeholder(param, param.device, param.requires_grad)
        self._switch(made, param.detach(), self._held.pop(id(made), frozenset()))
        return made

    def copied(self, param: nn.Parameter) -> nn.Parameter:
        """A deep copy of a parameter (a layer cloned): a new parameter with its value, which
        needs the parameter copied wherever it is kept (then real there)."""
        number = len(self.registered.params)
        source = param.root if isinstance(param, Placeholder) else param
        sources = self.sources(param) | {self._number(source)}
        if number in self.keep:
            if isinstance(param, Placeholder):
                raise _unbuildable(param)
            made: nn.Parameter = nn.Parameter(param.detach().clone(), param.requires_grad)
        else:  # no stand-in: building it must not lose another placeholder's value
            made = placeholder(param, getattr(param, "made_on", param.device), param.requires_grad)
            self._held[id(made)] = sources
        self.registered.add(made)
        self.registered.needs[number] = sources
        return made

    # ---------------------------------------------------------------- taint

    def _number(self, param: nn.Parameter) -> int:
        return self.registered.number.get(id(param), -1)

    def sources(self, value: Any) -> frozenset[int]:
        """The parameters a tensor's value needs."""
        if isinstance(value, Placeholder):
            root = value.root
            if root is not self._for or self._stand_in is None:  # its value is lost
                return self._held.get(id(root), frozenset({self._number(root)}))
            value = self._stand_in
        if isinstance(value, torch.Tensor) and len(self._taint):
            try:
                return self._taint.get(value.untyped_storage(), frozenset())
            except (NotImplementedError, RuntimeError):  # no storage (sparse, nested)
                return frozenset()
        return frozenset()

    def mark(self, value: Any, sources: frozenset[int], whole: bool = False) -> None:
        """`value` now holds what `sources` need (only those, when it was written `whole`)."""
        if isinstance(value, Placeholder):
            root = value.root
            if root is not self._for or self._stand_in is None:
                before = frozenset() if whole else self.sources(root)
                self._held[id(root)] = sources | before
                return
            value = self._stand_in
        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            return
        try:
            storage = value.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return
        if whole:
            if sources:
                self._taint[storage] = sources
            else:
                self._taint.pop(storage, None)
        elif sources:
            self._taint[storage] = self._taint.get(storage, frozenset()) | sources

    # ---------------------------------------------------------------- stand-ins

    def _switch(
        self, placeholder: Placeholder, stand_in: torch.Tensor, needs: frozenset[int]
    ) -> None:
        """`stand_in` holds `placeholder`'s value from now on, needing `needs`; the last
        one's value is lost."""
        previous = self._for
        if previous is not None and previous is not placeholder and self._stand_in is not None:
            self._held[id(previous)] = self.sources(self._stand_in) | {self._number(previous)}
        self.mark(stand_in, needs)
        self._for, self._stand_in = placeholder, stand_in

    def assign(self, placeholder: Placeholder, value: torch.Tensor) -> None:
        """`value` is the placeholder's value now (`placeholder.data = value`)."""
        root = placeholder.root
        self._held.pop(id(root), None)
        self._switch(root, value.detach(), frozenset())

    def standing_in(self, value: Any) -> Any:
        """A placeholder's stand-in (made for it now if another has it); anything else."""
        if not isinstance(value, Placeholder):
            return value
        root = value.root
        if root is not self._for or self._stand_in is None:  # a new scratch tensor
            lost = self._held.pop(id(root), frozenset({self._number(root)}))
            self._switch(root, _scratch(root), lost)
        stand_in = self._stand_in
        assert stand_in is not None
        if stand_in.dtype != root.dtype and stand_in.shape == root.shape:  # converted
            taint = self.sources(stand_in)
            self._stand_in = stand_in = stand_in.to(root.dtype)
            self.mark(stand_in, taint)
        return stand_in

    def converted(
        self, placeholder: Placeholder, device: torch.device | None = None, **to_copy: object
    ) -> torch.Tensor:
        """A placeholder converted (aten._to_copy's keywords: `.to(device)`, `.double()`):
        still no memory, on the meta device, noting the device it is said to be on."""
        result = aten._to_copy.default(placeholder, **to_copy, device=META)
        _MOVED_TO[result] = torch.device(device or placeholder.made_on)
        return result

    def convert(self, placeholder: Placeholder, converted: torch.Tensor) -> None:
        """`placeholder` holds its conversion now (`module.half()` assigns it back): on the
        device the conversion names; its stand-in, if it has it, converted alike (a plain
        build's `.half().float()` rounds)."""
        placeholder.made_on = _MOVED_TO.get(converted, placeholder.made_on)
        if placeholder.root is self._for and self._stand_in is not None:
            taint = self.sources(self._stand_in)
            self._stand_in = self._stand_in.to(placeholder.made_on, converted.dtype)
            self.mark(self._stand_in, taint)

    def call(self, func: Any, args: Any, kwargs: Any) -> Any:
        """`func` with its placeholders' stand-ins; the stand-in it returns (an in-place
        operation's result) as the placeholder given."""
        first = next(
            (v for v in tree_flatten((args, kwargs))[0] if isinstance(v, Placeholder)), None
        )
        args, kwargs = tree_map(self.standing_in, (args, kwargs))
        stand_in = self._stand_in
        result = func(*args, **kwargs)
        if first is None:
            return result
        return tree_map(lambda v: first if v is stand_in and first.root is self._for else v, result)

    def operation(self, func: Any, args: Any, kwargs: Any) -> Any:
        """One of torch's operations: run (on stand-ins), and its taint followed."""
        packet = func.overloadpacket
        if func is aten._to_copy.default and isinstance(args[0], Placeholder):
            return self.converted(args[0], **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        overwrite = packet in OVERWRITES
        if overwrite:  # all of the first argument written; copy_ reads its source
            read = flat[1:] if packet is aten.copy_ else []
        else:
            read = [] if packet in SHAPES_ONLY else flat
        sources = frozenset().union(*(self.sources(v) for v in read))
        if any(isinstance(v, Placeholder) for v in flat):
            result = self.call(func, args, kwargs)
        else:
            result = self.plain_operation(func, args, kwargs, flat)
        if overwrite and args:
            target = args[0]
            self.mark(target, sources, whole=isinstance(target, Placeholder) or is_whole(target))
        else:
            for v in written_arguments(func, args, kwargs):
                self.mark(v, sources)
        if sources:
            outputs, _ = tree_flatten(result)
            for v in outputs:
                if isinstance(v, torch.Tensor):
                    self.mark(v, sources)
            if packet in INTO_PYTHON:
                self.registered.everywhere |= sources
        return result

    def plain_operation(self, func: Any, args: Any, kwargs: Any, flat: list[Any]) -> Any:
        """An operation with no placeholder: a random one on a meta tensor that stands for a
        real one (not one the factory put there) draws on a scratch tensor too. What the
        factory makes on the meta device from nothing else is its own meta, as in a plain
        build."""
        meta = [v for v in flat if isinstance(v, torch.Tensor) and v.device.type == "meta"]
        stands_for_real = [v for v in meta if not self._is_own_meta(v)]
        if torch.Tag.nondeterministic_seeded in func.tags and stands_for_real:
            func(*tree_map(_scratch, args), **tree_map(_scratch, kwargs))
        result = func(*args, **kwargs)
        if not stands_for_real:
            for v in tree_flatten(result)[0]:
                if isinstance(v, torch.Tensor) and v.device.type == "meta":
                    self._own_meta[v.untyped_storage()] = True
        return result

    def _is_own_meta(self, value: torch.Tensor) -> bool:
        try:
            return value.untyped_storage() in self._own_meta
        except (NotImplementedError, RuntimeError):  # no storage (sparse, nested)
            return False

    def finish(self, model: nn.Module) -> None:
        """What each parameter's and buffer's final value needs."""
        for number, param in enumerate(self.registered.params):
            needs = self.sources(param) | self.registered.needs.get(number, frozenset())
            if needs - {number}:
                self.registered.needs[number] = needs - {number}
        for name, buffer in model.named_buffers(remove_duplicate=False):
            if needs := self.sources(buffer):
                self.registered.buffers[name] = needs
        self._for = self._stand_in = None


_ACTIVE: Standins | None = None  # the build under way (one at a time, as its hooks are)
_MOVED_TO = WeakIdKeyDictionary()  # a placeholder's conversion -> the device it is said to be on


class _Calls(TorchFunctionMode):
    """Swaps a placeholder for its stand-in where torch is called, before torch's own code
    (an RNN's, a deprecated weight norm's) compares its device with its other inputs'."""

    def __init__(self, standins: Standins):
        super().__init__()
        self.standins = standins

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        flat = tree_flatten((args, kwargs))[0]
        if name in OUT_OF_TORCH:  # values read where no operation of torch's sees them
            sources = frozenset().union(*(self.standins.sources(v) for v in flat))
            self.standins.registered.everywhere |= sources
        if name in AS_IS or not any(isinstance(v, Placeholder) for v in flat):
            return func(*args, **kwargs)
        return self.standins.call(func, args, kwargs)


class _Operations(TorchDispatchMode):
    """Follows the taint through every operation torch runs (its own code's too)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo's `disable` unless the mode says
        # otherwise (the opt-out its TorchDispatchMode documents), which imports torch._dynamo
        # and inductor into every process that builds a model: 100 MB of a stage's memory.
        # Nothing here runs under torch.compile.
        return False

    def __init__(self, standins: Standins):
        super().__init__()
        self.standins = standins

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        return self.standins.operation(func, args, kwargs or {})


def _unbuildable(param: nn.Parameter) -> RuntimeError:
    return RuntimeError(
        f"a parameter of shape {tuple(param.shape)} is kept but what it is made from is not"
        " (the master's plan and this process's build differ): the model's factory must make"
        " the same parameters in the same order in every process"
    )


def _is_lazy(param: nn.Parameter) -> bool:
    return isinstance(param, nn.parameter.UninitializedTensorMixin)


def _scratch(value: Any) -> Any:
    if isinstance(value, Placeholder):
        return torch.empty_strided(
            value.shape, value.stride(), dtype=value.dtype, device=value.made_on
        )
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
    return torch.device("cpu") if is_meta(value) else value
