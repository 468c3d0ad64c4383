"""Tracing with the shapes the job knows, where the plain trace fails (workloads/cut.py):
every traced value also carries what it is for the job's input on the meta device, for two
batch sizes, so what is the same for both is concrete while tracing; the graph begins with a
guard on the input's shape. How and what else: docs/architecture.md, "Tracing with the
job's shapes"."""

from __future__ import annotations

import builtins
import operator
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from pipejob.trainer.workloads import tracing
from pipejob.trainer.workloads.standins import META

_EINOPS = ("rearrange", "repeat", "reduce", "einsum", "pack", "unpack", "parse_shape")
_CONCRETE = (int, bool, float, str, torch.Size, torch.dtype, type(None))
_SIZE_ATTRS = {"shape", "ndim", "dtype", "is_cuda"}
_SIZE_METHODS = {
    "size",
    "dim",
    "ndimension",
    "numel",
    "nelement",
    "stride",
    "element_size",
    "is_floating_point",
    "is_complex",
    "is_contiguous",
}
BATCHES = (2, 3)  # the two batch sizes every traced value is followed for
# A function the meta device cannot run is run on the CPU (on made-up values of its inputs'
# shapes) only for inputs up to this size: activations of a few samples, not a model's tables.
CPU_BYTES = 64 << 20


def _einops_functions() -> tuple[Callable[..., Any], ...]:
    einops = sys.modules.get("einops")
    if einops is None:
        return ()
    return tuple(f for name in _EINOPS if callable(f := getattr(einops, name, None)))


def guard(inputs: Any, shape: tuple[int, ...]) -> Any:
    """The input a graph traced with shapes runs on, refused if its shape (its batch size
    aside) is not the one the trace was made for."""
    if isinstance(inputs, torch.Tensor) and tuple(inputs.shape[1:]) != shape:
        raise ValueError(
            f"the model was traced for inputs of shape (batch, {', '.join(map(str, shape))})"
            f" (the data's first batch), and sizes read from them are fixed in its stages;"
            f" this batch is {tuple(inputs.shape)}: every batch must have the first's shape"
        )
    return inputs


class ShapedProxy(fx.Proxy):
    """A traced value that answers what it is the same for both batch sizes."""

    def __getattr__(self, k: str) -> Any:
        if k in _SIZE_ATTRS:
            same = self.tracer.same(self.node, lambda v: getattr(v, k))
            if same is not _UNKNOWN:
                return same
            # A shape that follows the batch is itself a ShapedProxy (fx's would be an
            # Attribute, which answers no len()): `*img.shape` unpacks it into its sizes.
            return self.tracer.create_proxy("call_function", builtins.getattr, (self, k), {})
        return super().__getattr__(k)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """torch.Tensor where the traced value is a tensor: a library's type check
        (`isinstance(x, Tensor)`: kornia's KORNIA_CHECK_IS_TENSOR) passes as on the real
        value; `type()` still tells the stand-in (ShapedTracer.create_arg)."""
        tracer = self.tracer
        if not tracer.computing and isinstance(tracer.value_of(self.node), torch.Tensor):
            return torch.Tensor
        return type(self)

    def __len__(self) -> int:
        same = self.tracer.same(self.node, len)
        if same is _UNKNOWN:
            raise RuntimeError("len() of a traced value that follows the batch size")
        return same

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


_UNKNOWN = object()


class ShapedTracer(tracing.Tracer):
    """workloads/tracing.py's Tracer, following every traced value on the meta device for
    the job's input at two batch sizes (`sample`: a tensor of the input's shape and dtype)."""

    def __init__(self, model: nn.Module, leaves: set[str], sample: torch.Tensor):
        super().__init__(model, leaves)
        einops = _einops_functions()
        if einops:
            self._autowrap_function_ids |= {id(f) for f in einops}
            found = {sys.modules.get(type(m).__module__) for m in model.modules()}
            found.add(sys.modules["einops"])  # its own names, for a forward importing them
            self._autowrap_search = [*self._autowrap_search, *filter(None, found)]
        self.sample = sample
        self.computing = False  # while a value is computed: no tracing
        self.values: dict[fx.Node, tuple[Any, Any] | None] = {}
        self.sizes: set[fx.Node] = set()  # nodes that read sizes (or compute with them)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ShapedProxy(node, self)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if type(m).__module__.startswith("einops"):
            return True
        return super().is_leaf_module(m, qualname)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, fx.Proxy]) -> Any:
        if self.computing:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if self.computing:
            return forward(*args, **kwargs)
        try:
            self.path_of_module(m)
        except NameError:  # made inside the forward (`nn.ReLU()(x)`): traced through
            if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None:
                raise
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def create_args_for_root(
        self, root_fn: Any, is_module: bool, concrete_args: Any = None
    ) -> tuple[Any, list[Any]]:
        fn, (root, x) = super().create_args_for_root(root_fn, is_module, concrete_args)
        shape = tuple(self.sample.shape[1:])
        guarded = self.create_proxy("call_function", guard, (x, shape), {})
        return fn, [root, guarded]

    def create_proxy(
        self,
        kind: str,
        target: Any,
        args: Any,
        kwargs: Any,
        name: Any = None,
        type_expr: Any = None,
        proxy_factory_fn: Any = None,
    ) -> Any:
        """A traced value; a size read from traced tensors that is the same for both batch
        sizes, as that concrete value (what it is read from is followed on the meta device
        only then: the rest of the trace costs what fx's costs)."""
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        node = proxy.node
        if not self._reads_a_size(node):
            return proxy
        self.sizes.add(node)
        if target is builtins.getattr:  # `x.shape`, made when used: ShapedProxy answers
            return proxy
        same = self.same(node, lambda value: value)
        if same is _UNKNOWN or node.users:
            return proxy
        self.graph.erase_node(node)
        return same

    def _reads_a_size(self, node: fx.Node) -> bool:
        if node.op == "call_method":
            return node.target in _SIZE_METHODS
        if node.op != "call_function":
            return False
        if node.target is builtins.getattr:
            return node.args[1] in _SIZE_ATTRS
        if node.target is len or getattr(node.target, "__module__", None) == "_operator":
            inputs = node.all_input_nodes
            return bool(inputs) and all(n in self.sizes for n in inputs)
        return False

    def same(self, node: fx.Node, read: Callable[[Any], Any]) -> Any:
        """What `read` gives for `node`'s values, where it is the same for both batch
        sizes and concrete; else _UNKNOWN."""
        values = self._values(node)
        if values is None:
            return _UNKNOWN
        try:
            a, b = read(values[0]), read(values[1])
        except Exception:
            return _UNKNOWN
        return a if _concrete(a) and type(a) is type(b) and a == b else _UNKNOWN

    def create_arg(self, a: Any) -> Any:
        if type(a) is ShapedProxy:  # a stand-in, whatever class it says it is
            return a.node
        return super().create_arg(a)

    def value_of(self, node: fx.Node) -> Any:
        """`node`'s value for the first batch size on the meta device (None if unknown)."""
        values = self._values(node)
        return None if values is None else values[0]

    def iter(self, obj: fx.Proxy) -> Any:
        length = self.same(obj.node, len)
        if length is _UNKNOWN:
            return super().iter(obj)
        return iter([obj[i] for i in range(length)])

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        graph = super().trace(root, concrete_args)
        for node in reversed(list(graph.nodes)):  # sizes read and then not needed
            if not node.users and _reads_only(node):
                graph.erase_node(node)
        return graph

    def to_bool(self, obj: fx.Proxy) -> bool:
        same = self.same(obj.node, bool)
        return super().to_bool(obj) if same is _UNKNOWN else same

    def _values(self, node: fx.Node) -> tuple[Any, Any] | None:
        """`node`'s value for each batch size, on the meta device (None where unknown),
        computed with those of the nodes it is computed from, once."""
        if node in self.values:
            return self.values[node]
        needed, todo = set(), [node]
        while todo:
            n = todo.pop()
            if n not in self.values and n not in needed:
                needed.add(n)
                todo.extend(n.all_input_nodes)
        for n in [n for n in self.graph.nodes if n in needed]:  # in the graph's order
            known = all(self.values.get(a) is not None for a in n.all_input_nodes)
            self.values[n] = self._compute(n) if known else None
        return self.values.get(node)

    def _compute(self, node: fx.Node) -> tuple[Any, Any] | None:
        try:
            with _computing(self), torch.no_grad():
                return self._value(node, 0), self._value(node, 1)
        except Exception:
            return self._on_cpu(node) if node.op == "call_function" else None

    def _on_cpu(self, node: fx.Node) -> tuple[Any, Any] | None:
        """A function the meta device cannot run (it reads a value into Python: a mask
        builder's `.item()`), run on the CPU on inputs of the same shapes filled with zeros and
        then with ones: its outputs as meta tensors where their shapes do not depend on those
        values; else None (unknown)."""
        inputs = tree_leaves([self.values.get(n) for n in node.all_input_nodes])
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        if sum(t.numel() * t.element_size() for t in tensors) > CPU_BYTES:
            return None
        try:
            with _computing(self), torch.no_grad():
                runs = [(self._value(node, 0, fill), self._value(node, 1, fill)) for fill in (0, 1)]
        except Exception:
            return None
        shapes = [tree_map_only(torch.Tensor, lambda v: v.shape, run) for run in runs]
        if shapes[0] != shapes[1]:
            return None
        return tree_map(_meta, runs[0])

    def _value(self, node: fx.Node, i: int, fill: int | None = None) -> Any:
        """`node`'s value for batch size i from its inputs' (with `fill`, on the CPU: the
        inputs made of that value, of their shapes and dtypes)."""

        def argument_value(a: Any) -> Any:
            value = self.values[a][i] if isinstance(a, fx.Node) else a  # type: ignore[index]
            return value if fill is None else tree_map(lambda v: _filled(v, fill), value)

        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), argument_value)
        if node.op == "placeholder":
            return torch.empty(
                (BATCHES[i], *self.sample.shape[1:]), dtype=self.sample.dtype, device=META
            )
        if node.op == "get_attr":
            return _meta(fx.graph_module._get_attr(self.root, str(node.target)))
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            module = self.root.get_submodule(str(node.target))
            state = {n: _meta(t) for n, t in _state(module)}
            return torch.func.functional_call(module, state, tuple(args), kwargs)
        raise LookupError(node.op)


class _computing:
    """While a value is computed: modules run as they are, attributes are what they are,
    and random draws are allowed (they are drawn on the meta device)."""

    def __init__(self, tracer: ShapedTracer):
        self.tracer = tracer

    def __enter__(self) -> None:
        self.before = self.tracer.computing, tracing.RandomDraws.allowed
        self.tracer.computing = tracing.RandomDraws.allowed = True

    def __exit__(self, *exc: object) -> None:
        self.tracer.computing, tracing.RandomDraws.allowed = self.before


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type != "meta":
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=META)
    return value


def _filled(value: Any, fill: int) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return torch.full(value.shape, fill, dtype=value.dtype)
    return value


def _concrete(value: Any) -> bool:
    if isinstance(value, tuple | list):
        return all(map(_concrete, value))
    return isinstance(value, _CONCRETE)


def _reads_only(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in (builtins.getattr, operator.getitem, builtins.len)
    return node.op == "call_method" and node.target in ("size", "dim", "numel")


def _state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
