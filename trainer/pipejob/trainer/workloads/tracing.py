"""How torch.fx sees a model for the cut (workloads/cut.py): a tracer with the cut
candidates as leaves (modules opened into candidates traced into, torch.nn's own too), calling
the forward as the pipeline does (one positional input), noting the innermost module whose
forward failed to trace, keeping the objects a forward passes to calls as they are (a config,
a ModelOutput). Hugging Face's mask builders run as calls of their own (they branch on the
inputs) and its key/value cache is off while tracing (workloads/model_guards.py). A random
draw from no traced value (LayerDrop's `torch.rand([]) < p`) would be frozen into the graph:
the module whose forward draws it is kept whole, so the draw happens at every step as in the
model."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from pipejob.trainer.workloads.model_guards import holds_traced, unchanged


def _mask_builders() -> tuple[Any, ...]:
    """Hugging Face's attention-mask builders, when transformers is loaded: they branch on
    the inputs' values (skipping a mask that is all ones), so they run as calls of their own."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        return ()
    return tuple(f for n, f in vars(masking).items() if n.startswith("create_") and callable(f))


def materialize_masks(graph: fx.Graph) -> None:
    """A mask builder's call that code between the modules uses (SqueezeBERT adds the mask
    to its scores) made to build its mask always: a builder skips a mask that masks nothing
    (returns None) when run, where the trace, seeing a value, took it for one (`if mask is
    not None`). Its mask then masks nothing, as None would. Calls only modules take keep
    the skip: their code tests the None when run."""
    skips = ("allow_is_causal_skip", "allow_is_bidirectional_skip")
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _mask_builders():
            continue
        if all(user.op == "call_module" for user in node.users):
            continue
        flags = [k for k in skips if k in inspect.signature(node.target).parameters]
        node.kwargs = {**node.kwargs, **dict.fromkeys(flags, False)}


class Objects(fx.Tracer):
    """fx's tracer keeping the objects a forward passes to calls as they are: a Hugging Face
    ModelOutput is rebuilt as itself (fx would make a plain dict of it, and the loss gets
    what the model returns); any other dataclass that holds nothing traced (a Hugging Face
    config given to a mask builder) is the object itself, held by the stage: fx would
    rebuild it from its fields, losing what is not a field (the config's attention kind,
    which decides the mask: a Mistral's sliding window was lost so); a numpy scalar is the
    Python number it is. A stage's graph names this tracer, so a pickled stage, traced
    again from its code, keeps them too.

    Buffers read as attributes are traced values, as parameters are: a forward that updates
    one in place (timm's BatchNormAct2d counting `num_batches_tracked`) records the update in
    the graph, where the stage runs it; fx's default runs it on the real buffer while tracing
    (a stage's build changed its state) and leaves it out of the graph. Their size is
    answered as it is (`BufferProxy`): a forward may check it (timm's EVA asserts its rotary
    periods' `numel()`), which a traced value could not answer."""

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, fx.Proxy]) -> Any:
        if isinstance(attr_val, torch.Tensor):
            proxy = self._held_tensor(attr_val, parameter_proxy_cache)
            if proxy is not None:
                return proxy
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def _held_tensor(self, value: torch.Tensor, cache: dict[str, fx.Proxy]) -> fx.Proxy | None:
        """The one traced value of the root's parameter or buffer `value` (fx keeps one per
        parameter; buffers get the same, as fx's `proxy_buffer_attributes` with a proxy that
        knows their size); None where the root holds no such tensor."""
        if isinstance(value, nn.Parameter):
            held, proxy_class = self.root.named_parameters(), ParameterProxy
        else:
            held, proxy_class = self.root.named_buffers(), BufferProxy
        name = next((n for n, t in held if t is value), None)
        if name is not None and name not in cache:
            cache[name] = self.create_proxy(
                "get_attr",
                name,
                (),
                {},
                proxy_factory_fn=lambda node: proxy_class(node, self, value),
            )
        return None if name is None else cache[name]

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, dict) and dataclasses.is_dataclass(a):
            fields = {k: self.create_arg(v) for k, v in a.items()}
            node = self.create_node("call_function", type(a), (), fields)
            node.meta["is_wrapped"] = True
            return node
        if dataclasses.is_dataclass(a) and not isinstance(a, type) and not holds_traced(a):
            held = next((k for k, v in vars(self.root).items() if v is a), None)
            if held is None:
                held = self.get_fresh_qualname(f"_{type(a).__name__}_constant_")
                setattr(self.root, held, a)
            return self.create_node("get_attr", held, (), {})
        if type(a).__module__ == "numpy" and getattr(a, "ndim", None) == 0:
            return a.item()  # a numpy scalar (CTRL's np.sqrt): fx's code would not name numpy
        return super().create_arg(a)


def _answered(attribute: str) -> property:
    """A proxy's attribute answered as its tensor's while tracing, not traced."""
    return property(lambda proxy: getattr(proxy.buffer, attribute))


class BufferProxy(fx.Proxy):
    """A traced buffer that answers its size as the buffer's (as fx's ParameterProxy does
    for parameters): what it holds is read when the graph runs, its size while tracing.
    Its dtype and device stay traced: a stage moves its pieces to its device after tracing."""

    def __init__(self, node: fx.Node, tracer: Any, buffer: torch.Tensor):
        super().__init__(node, tracer)
        self.buffer = buffer

    shape = _answered("shape")
    ndim = _answered("ndim")

    def size(self, dim: int | None = None) -> Any:
        return self.buffer.size() if dim is None else self.buffer.size(dim)

    def dim(self) -> int:
        return self.buffer.dim()

    def numel(self) -> int:
        return self.buffer.numel()

    def nelement(self) -> int:
        return self.buffer.nelement()

    def __len__(self) -> int:
        return len(self.buffer)


class ParameterProxy(BufferProxy):
    """A traced parameter that answers what it is, not what it holds, as the parameter's:
    its size (as BufferProxy), dtype, requires_grad and whether it is floating point
    (every process builds it alike); its device as the device of the stage that runs the
    code (`device_here`: a stage moves its pieces to its device after tracing). Reading
    them is not a use: a parameter whose traced value only they read is not placed in the
    stage that reads them (`place_parameters`), so no stage holds a copy for them (open_clip
    reads a later block's weight's dtype at its start)."""

    dtype = _answered("dtype")
    requires_grad = _answered("requires_grad")

    def is_floating_point(self) -> bool:
        return self.buffer.is_floating_point()

    @property
    def device(self) -> Any:
        return self.tracer.create_proxy("call_function", device_here, (), {})


_DEVICE: ContextVar[Callable[[], torch.device]] = ContextVar("device_here")


def device_here() -> torch.device:
    """The device of the stage running (a parameter's device, read in its forward: all of
    a stage's parameters are on its device)."""
    where = _DEVICE.get(None)
    return torch.device("cpu") if where is None else where()


@contextmanager
def running_on(device: Callable[[], torch.device]) -> Iterator[None]:
    """While a stage runs: `device()` says where (asked only when a forward reads it)."""
    token = _DEVICE.set(device)
    try:
        yield
    finally:
        _DEVICE.reset(token)


def place_parameters(graph: fx.Graph, model: nn.Module) -> None:
    """Each parameter's traced value read just before the first node that computes with
    it, and not at all where none does (only its size, dtype or device was read): where it
    is read decides which stage holds it."""
    params = {name for name, _ in model.named_parameters()}
    order = {n: i for i, n in enumerate(graph.nodes)}  # moving a get_attr keeps the others'
    for node in list(graph.nodes):
        if node.op != "get_attr" or node.target not in params:
            continue
        if not node.users:
            graph.erase_node(node)
        else:
            min(node.users, key=order.__getitem__).prepend(node)


class Tracer(Objects):
    """fx's tracer with the cut candidates as leaves, the forward called with one input,
    and a note of the innermost module whose forward failed to trace."""

    def __init__(self, model: nn.Module, leaves: set[str]):
        builders = _mask_builders()
        super().__init__(autowrap_functions=builders)
        if builders:  # where the models' own modules call them
            found = {sys.modules.get(type(m).__module__) for m in model.modules()}
            self._autowrap_search = [*self._autowrap_search, *filter(None, found)]
        self.leaves = leaves
        # Modules opened into candidates: traced into, even torch.nn's own (fx's leaves).
        self.opened = {
            name.rsplit(".", i)[0] for name in leaves for i in range(1, name.count(".") + 1)
        }
        self.failed_in: str | None = None  # "" for the model's own forward

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.opened:
            return False
        return qualname in self.leaves or super().is_leaf_module(m, qualname)

    def create_args_for_root(
        self, root_fn: Any, is_module: bool, concrete_args: Any = None
    ) -> tuple[Any, list[Any]]:
        # The pipeline calls the model with one positional input; tracing that call (rather
        # than the signature, which may be `(*args, **kwargs)` behind a decorator) keeps
        # every other argument's default and gives stage 0 one placeholder.
        try:
            params = list(inspect.signature(inspect.unwrap(root_fn)).parameters)[1:]
        except (TypeError, ValueError):  # no signature to read: any name does
            params = []
        name = params[0] if params and params[0].isidentifier() else "inputs"
        x = self.create_proxy("placeholder", name, (), {})
        return (lambda root, x: root_fn(root, x)), [self.root, x]

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            name = self.path_of_module(m)
        except NameError:
            return super().call_module(m, forward, args, kwargs)
        if self.is_leaf_module(m, name):
            return _as_returned(super().call_module(m, forward, args, kwargs), m, args, kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = name
            raise

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        try:
            with RandomDraws():
                return super().trace(root, concrete_args)
        except Exception:
            if self.failed_in is None:
                self.failed_in = ""
            raise


class _Alone(Objects):
    """fx's tracer for one module's forward by itself, called as the model calls it (the
    values the trace made, placeholders; the others, as they are)."""

    def __init__(self, args: Any, kwargs: Any):
        super().__init__()
        self.call = (args, kwargs)

    def create_args_for_root(
        self, root_fn: Any, is_module: bool, concrete_args: Any = None
    ) -> tuple[Any, list[Any]]:
        count = iter(range(sys.maxsize))

        def placeholder(a: Any) -> Any:
            if not isinstance(a, fx.Proxy):
                return a
            return self.create_proxy("placeholder", f"a{next(count)}", (), {})

        args, kwargs = fx.node.map_aggregate(self.call, placeholder)
        return (lambda root: root_fn(root, *args, **kwargs)), [self.root]


def _as_returned(proxy: fx.Proxy, module: nn.Module, args: Any, kwargs: Any) -> Any:
    """A module's result as the trace goes on with it, when the trace does not open the
    module: the one traced value fx makes of it; or, where its forward, traced alone, returns
    a tuple or list holding a None, that tuple or list of its traced items and the None. A
    caller's `if x is not None` then decides as it will when run, where a traced value would
    always be taken for one (Hiera's embeddings return no mask unless pretraining)."""
    before = set(vars(module))
    try:
        with unchanged(module):
            graph = _Alone(args, kwargs).trace(module)
    except Exception:  # its forward does not trace alone: one traced value
        return proxy
    finally:  # the constants fx held on it
        for key in set(vars(module)) - before:
            del vars(module)[key]
    return _shaped(proxy, next(n for n in graph.nodes if n.op == "output").args[0])


def _shaped(proxy: fx.Proxy, returned: Any) -> Any:
    if returned is None:
        return None
    if type(returned) in (tuple, list) and _holds_none(returned):
        return type(returned)(_shaped(proxy[i], v) for i, v in enumerate(returned))
    return proxy


def _holds_none(value: Any) -> bool:
    return value is None or (type(value) in (tuple, list) and any(map(_holds_none, value)))


# torch's functions that draw random values: called on no traced value while tracing, their
# draw would be a constant of the graph.
RANDOM = frozenset(
    {
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
        torch.bernoulli,
        torch.multinomial,
        torch.normal,
        torch.poisson,
    }
)


class RandomDraws(TorchFunctionMode):
    """While tracing: a random draw from no traced value fails the trace of the module
    whose forward makes it (Tracer.failed_in), which is then kept whole."""

    allowed = False  # while workloads/shapes.py computes a value on the meta device

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in RANDOM and not self.allowed and not holds_traced((args, kwargs)):
            raise fx.proxy.TraceError(
                f"torch.{func.__name__} draws a random value outside"
                " the graph (fx would freeze one draw)"
            )
        return func(*args, **kwargs)
