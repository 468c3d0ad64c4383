"""The parameters a process does not keep, while the user's factory builds the model
(workloads/materialize.py): each is a placeholder on the meta device, and what the factory
does to it runs on a scratch tensor standing in for it, one placeholder's at a time, so the
random stream advances as in a plain build. A placeholder's value lives only while its
stand-in does; values computed from one whose stand-in was lost are followed (tainted with
its number) into the parameters and buffers they end in, which then need it: so the plan can
keep it where they are kept."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

META = torch.device("meta")
aten = torch.ops.aten

# In-place operations that write all of their first argument without reading it.
_OVERWRITES = {aten.uniform_, aten.normal_, aten.fill_, aten.zero_, aten.random_,
               aten.bernoulli_, aten.exponential_, aten.geometric_, aten.log_normal_,
               aten.cauchy_, aten.copy_}  # fmt: skip
# Operations that read only their arguments' shapes, not their values.
_SHAPES_ONLY = {aten.empty_like, aten.new_empty, aten.new_empty_strided, aten.new_zeros,
                aten.new_ones, aten.new_full, aten.zeros_like, aten.ones_like, aten.full_like,
                aten.rand_like, aten.randn_like, aten.randint_like}  # fmt: skip
# Operations that read a tensor's values into Python (a branch may follow).
_INTO_PYTHON = {aten._local_scalar_dense, aten.is_nonzero, aten.equal}


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
    def data(self) -> Placeholder:  # type: ignore[override]
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        torch._C.TensorBase.data.__set__(self, value)  # type: ignore[attr-defined]

    @property
    def root(self) -> Placeholder:
        return self if self.source is None else self.source


def placeholder(like: torch.Tensor, device: torch.device, requires_grad: bool,
                 source: Placeholder | None = None) -> Placeholder:  # fmt: skip
    made = Placeholder(meta_like(like), requires_grad)
    made.made_on, made.source = device, source
    return made


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


class Standins(TorchDispatchMode):
    """While the factory runs: operations on a placeholder run on a scratch tensor standing
    in for it, one placeholder's at a time (a new parameter's first stand-in is the tensor
    the factory made); any other random operation on a meta tensor runs again on a scratch
    tensor. So the random stream advances as in a plain build.

    And it follows where values read from placeholders go: a tensor computed from a
    placeholder whose stand-in was lost meanwhile (its value is only right where the
    parameter is kept) is tainted with that parameter's number, and so is whatever is
    computed from it in turn. What a parameter's or buffer's final value is tainted with
    are the parameters it needs (`Registrations.needs`, `.buffers`); a tainted value read
    into Python (a branch) needs them everywhere."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo's `disable` unless the mode says
        # otherwise (the opt-out its TorchDispatchMode documents), which imports torch._dynamo
        # and inductor into every process that builds a model: 100 MB of a stage's memory.
        # Nothing here runs under torch.compile.
        return False

    def __init__(self, registered: Registrations, keep: set[int]) -> None:
        super().__init__()
        self.registered, self.keep = registered, keep
        self._for: Placeholder | None = None  # whose value `_stand_in` holds
        self._stand_in: torch.Tensor | None = None
        self._lost: set[int] = set()  # ids of placeholders whose stand-in was lost
        self._held: dict[int, frozenset[int]] = {}  # a placeholder's taint, off its stand-in
        self._taint = WeakIdKeyDictionary()  # a storage -> the numbers its values need

    # ---------------------------------------------------------------- parameters made

    def made(self, param: nn.Parameter) -> nn.Parameter:
        """A parameter registered for the first time: itself where kept, else a placeholder
        whose first stand-in is the parameter itself."""
        number = len(self.registered.params)
        if isinstance(param, Placeholder):  # a placeholder's alias: its value is the source's
            if number in self.keep:
                raise _unbuildable(param)
            self.registered.needs[number] = self._sources(param) | {self._number(param.root)}
            return param
        if number in self.keep or param.device.type == "meta" or _is_lazy(param):
            return param
        made = placeholder(param, param.device, param.requires_grad)
        self._switch(made, param.detach())
        return made

    def copied(self, param: nn.Parameter) -> nn.Parameter:
        """A deep copy of a parameter (a layer cloned): a new parameter with its value, which
        needs the parameter copied wherever it is kept."""
        number = len(self.registered.params)
        source = param.root if isinstance(param, Placeholder) else param
        sources = self._sources(param) | {self._number(source)}
        if number in self.keep:
            value = self._value(param)
            if value is None:
                raise _unbuildable(param)
            made: nn.Parameter = nn.Parameter(value.clone(), param.requires_grad)
        else:  # no stand-in: building it must not lose another placeholder's value
            made = placeholder(param, getattr(param, "made_on", param.device),
                                param.requires_grad)  # fmt: skip
            self._lost.add(id(made))
            self._held[id(made)] = sources
        self.registered.add(made)
        self.registered.needs[number] = sources
        return made

    def _value(self, param: nn.Parameter) -> torch.Tensor | None:
        """A parameter's value where it is known: a real one's, a placeholder's stand-in."""
        if not isinstance(param, Placeholder):
            return param.detach()
        root = param.root
        if root is self._for and id(root) not in self._lost:
            return self._stand_in
        return None

    # ---------------------------------------------------------------- taint

    def _number(self, param: nn.Parameter) -> int:
        return self.registered.number.get(id(param), -1)

    def _sources(self, value: Any) -> frozenset[int]:
        """The parameters a tensor's value needs: a placeholder whose stand-in was lost
        needs itself; any value needs what its storage is tainted with."""
        if isinstance(value, Placeholder):
            root = value.root
            held = self._held.get(id(root), frozenset())
            if root is self._for and self._stand_in is not None:
                held = self._taint.get(self._stand_in.untyped_storage(), frozenset())
            if id(root) in self._lost:
                return held | {self._number(root)}
            return held
        if isinstance(value, torch.Tensor) and len(self._taint):
            try:
                return self._taint.get(value.untyped_storage(), frozenset())
            except (NotImplementedError, RuntimeError):  # no storage (sparse, nested)
                return frozenset()
        return frozenset()

    def _mark(self, value: Any, sources: frozenset[int], reset: bool = False) -> None:
        """`value` now holds what `sources` need (only those, when `reset`)."""
        if isinstance(value, Placeholder):
            root = value.root
            if root is not self._for or self._stand_in is None:
                before = frozenset() if reset else self._held.get(id(root), frozenset())
                self._held[id(root)] = sources | before
                return
            value = self._stand_in
        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            return
        try:
            storage = value.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return
        if reset:
            if sources:
                self._taint[storage] = sources
            else:
                self._taint.pop(storage, None)
        elif sources:
            self._taint[storage] = self._taint.get(storage, frozenset()) | sources

    # ---------------------------------------------------------------- stand-ins

    def _switch(self, placeholder: Placeholder, stand_in: torch.Tensor) -> None:
        """`stand_in` holds `placeholder`'s value from now on; the last one's is lost."""
        previous = self._for
        if previous is not None and previous is not placeholder and self._stand_in is not None:
            self._held[id(previous)] = self._taint.get(self._stand_in.untyped_storage(),
                                                       frozenset())  # fmt: skip
            self._lost.add(id(previous))
        held = self._held.pop(id(placeholder), frozenset())  # and what the tensor holds
        if held:
            self._mark(stand_in, held)
        self._for, self._stand_in = placeholder, stand_in

    def _standing_in(self, value: Any) -> Any:
        if not isinstance(value, Placeholder):
            return value
        root = value.root
        if root is not self._for or self._stand_in is None:
            self._switch(root, _scratch(root))  # its value is lost: a new scratch tensor
        stand_in = self._stand_in
        assert stand_in is not None
        if stand_in.dtype != root.dtype and stand_in.shape == root.shape:  # converted
            taint = self._taint.get(stand_in.untyped_storage())
            self._stand_in = stand_in = stand_in.to(root.dtype)
            if taint:
                self._taint[stand_in.untyped_storage()] = taint
        return stand_in

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if func is aten._to_copy.default and isinstance(args[0], Placeholder):
            return func(*args, **kwargs)  # a conversion (`.double()`): still no memory
        flat, _ = tree_flatten((args, kwargs))
        overwrite = packet in _OVERWRITES
        if overwrite:  # all of the first argument written; copy_ reads its source
            read = flat[1:] if packet is aten.copy_ else []
        else:
            read = [] if packet in _SHAPES_ONLY else flat
        sources = frozenset().union(*(self._sources(v) for v in read))
        if any(isinstance(v, Placeholder) for v in flat):
            # What the stand-in itself is returned as (an in-place operation's result): the
            # placeholder given, or the one it stands in for.
            stand_ins = tree_map(self._standing_in, (args, kwargs))
            first = args[0] if args and isinstance(args[0], Placeholder) else self._for
            result = func(*stand_ins[0], **stand_ins[1])
            result = tree_map(lambda v: first if v is self._stand_in else v, result)
        else:
            if torch.Tag.nondeterministic_seeded in func.tags and any(map(_is_meta, flat)):
                func(*tree_map(_scratch, args), **tree_map(_scratch, kwargs))
            result = func(*args, **kwargs)
        if overwrite and args:
            target = args[0]
            whole = isinstance(target, Placeholder) or _whole(target)
            self._mark(target, sources, reset=whole)
            if isinstance(target, Placeholder) and whole:
                self._lost.discard(id(target.root))
        else:
            for v in _written(func, args, kwargs):
                self._mark(v, sources)
        if sources:
            outputs, _ = tree_flatten(result)
            for v in outputs:
                if isinstance(v, torch.Tensor):
                    self._mark(v, sources)
            if packet in _INTO_PYTHON:
                self.registered.everywhere |= sources
        return result

    def finish(self, model: nn.Module) -> None:
        """What each parameter's and buffer's final value needs."""
        for number, param in enumerate(self.registered.params):
            needs = self._sources(param) - {number}
            if isinstance(param, Placeholder) and id(param.root) in self._lost:
                needs = needs - {self._number(param.root)}
            needs |= self.registered.needs.get(number, frozenset())
            if needs:
                self.registered.needs[number] = needs - {number}
        for name, buffer in model.named_buffers(remove_duplicate=False):
            if needs := self._sources(buffer):
                self.registered.buffers[name] = needs
        self._for = self._stand_in = None


def meta_like(like: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=META)


def _unbuildable(param: nn.Parameter) -> RuntimeError:
    return RuntimeError(
        f"a parameter of shape {tuple(param.shape)} is kept but what it is made from is not"
        " (the master's plan and this process's build differ): the model's factory must make"
        " the same parameters in the same order in every process"
    )


def _is_lazy(param: nn.Parameter) -> bool:
    return isinstance(param, nn.parameter.UninitializedTensorMixin)


def _whole(value: Any) -> bool:
    """Whether a tensor is all of its storage (writing it replaces every value there)."""
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        return False
    try:
        storage = value.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return False
    return value.storage_offset() == 0 and value.nbytes == storage.nbytes()


def _written(func: Any, args: Any, kwargs: Any) -> list[Any]:
    """The arguments an in-place or out= operation writes."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            written.append(value)
    return written


def _is_meta(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "meta"
    return isinstance(value, torch.device) and value.type == "meta"


def _scratch(value: Any) -> Any:
    if isinstance(value, Placeholder):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device=value.made_on)  # fmt: skip
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
    return torch.device("cpu") if _is_meta(value) else value
