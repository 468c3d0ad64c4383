"""Any model cut into pipeline stages at module names, keeping the original parameter names.

Cut candidates come from the module tree: the model's children (plain `Sequential`,
`ModuleList` and `ModuleDict` containers opened into their items), and, while there are
fewer than the balance needs, the children of the largest candidate (a wrapper opens into
what it wraps, a Hugging Face `transformer` into its embeddings, `h.0`, `h.1`, ... and
norm); `splitPoints` open whatever is above the modules they name. torch.fx traces the
model's forward with every candidate as a leaf, so only the glue between candidates must be
traceable (a candidate's own forward may hold any Python). Where fx cannot trace a module's
forward, that module stays whole (a unit of its own) and tracing starts again; only the
model's own forward must trace.

The forward is traced as the pipeline calls it: with one positional input (a batch of the
data's inputs); other arguments keep their defaults. Hugging Face models trace as they are:
their mask builders run as calls of their own (they branch on the inputs), the key/value
cache is off while tracing (training needs none), and what they return is rebuilt as their
ModelOutput.

The graph is then cut where stages begin: each stage is a GraphModule made from the original
model, so its parameters and buffers keep their original names (`transformer.h.3.attn.c_attn
.weight`), and the stages' state dicts together are the model's. Whatever the forward carries
across a cut (one tensor or several: a residual stream, a mask, a size) is passed on: stage k
takes the values live at its start as positional arguments and returns those live at its end,
as a tuple; the last stage returns the model's output. A parameter two stages use (tied input
and output embeddings) is in both, and `ties` names it so the pipeline can combine its
gradients.

Why not torch.distributed.pipelining's tracer (torch.export): it bakes training mode into
the graph (a BatchNorm in `.eval()` still updates its statistics, measured), its stages do
not pickle, tracing ResNet-18 takes 1.4 s against fx's 0.02 s, and it cannot capture
transformers 5's GPT-2 at all ("cannot capture your model as a full graph", measured), which
this tracer cuts in 0.03 s."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class CutError(ValueError):
    """The model cannot be cut as asked: the message says why and what can be done."""


def candidates(model: nn.Module, want: int = 0, required: Sequence[str] = (),
               whole: frozenset[str] = frozenset()) -> list[str]:  # fmt: skip
    """Module names where a stage may begin, in the module tree's order: the model's
    children, then the modules above each `required` name opened, then the largest
    candidate opened (most parameters; the first on a tie) while there are fewer than
    `want`. Modules in `whole` (their forward does not trace) are never opened."""
    modules = dict(model.named_modules())

    def children(prefix: str, module: nn.Module) -> list[str]:
        found = []
        for name, child in module.named_children():
            if type(child) in CONTAINERS:  # plain containers only: subclasses are units
                found += children(f"{prefix}{name}.", child)
            else:
                found.append(f"{prefix}{name}")
        return found

    def openable(name: str) -> bool:
        return name not in whole and next(modules[name].children(), None) is not None

    units = children("", model)

    def open_(name: str) -> None:
        i = units.index(name)
        units[i : i + 1] = children(f"{name}.", modules[name])

    for point in required:  # a split point deeper down: open the modules above it
        while point not in units:
            above = next((u for u in units if point.startswith(f"{u}.")), None)
            if above is None or not openable(above):
                break  # Traced.ranges says why it cannot begin a stage
            open_(above)
    size = {n: sum(p.numel() for p in m.parameters()) for n, m in modules.items()}
    while len(units) < want:
        options = [u for u in units if openable(u) and u not in required]
        if not options:
            break
        open_(max(options, key=lambda u: (size[u], -units.index(u))))
    return units


def _mask_builders() -> tuple[Any, ...]:
    """Hugging Face's attention-mask builders, when transformers is loaded: they branch on
    the inputs' values (skipping a mask that is all ones), so they run as calls of their own."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        return ()
    return tuple(f for n, f in vars(masking).items() if n.startswith("create_") and callable(f))


class _Tracer(fx.Tracer):
    """fx's tracer with the cut candidates as leaves, the forward called with one input,
    and a note of the innermost module whose forward failed to trace."""

    def __init__(self, model: nn.Module, leaves: set[str]):
        builders = _mask_builders()
        super().__init__(autowrap_functions=builders)
        if builders:  # where the models' own modules call them
            found = {sys.modules.get(type(m).__module__) for m in model.modules()}
            self._autowrap_search = [*self._autowrap_search, *filter(None, found)]
        self.leaves = leaves
        self.failed_in: str | None = None  # "" for the model's own forward

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)

    def create_args_for_root(self, root_fn: Any, is_module: bool,
                             concrete_args: Any = None) -> tuple[Any, list[Any]]:  # fmt: skip
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
            return super().call_module(m, forward, args, kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = name
            raise

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        try:
            return super().trace(root, concrete_args)
        except Exception:
            if self.failed_in is None:
                self.failed_in = ""
            raise

    def create_arg(self, a: Any) -> Any:
        # A Hugging Face ModelOutput (a dataclass and a dict) is rebuilt as itself, not as a
        # plain dict, so the loss gets what the model returns.
        if isinstance(a, dict) and dataclasses.is_dataclass(a):
            fields = {k: self.create_arg(v) for k, v in a.items()}
            node = self.create_node("call_function", type(a), (), fields)
            node.meta["is_wrapped"] = True  # a pickled stage, traced again, keeps it too
            return node
        return super().create_arg(a)


@contextmanager
def without_cache(model: nn.Module) -> Iterator[None]:
    """A Hugging Face model traced with its key/value cache off (`config.use_cache`):
    training needs none, and the cache object cannot be passed between stages."""
    configs = {id(c): c for m in model.modules()
               if hasattr(c := getattr(m, "config", None), "use_cache")}  # fmt: skip
    before = {k: c.use_cache for k, c in configs.items()}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for k, c in configs.items():
            c.use_cache = before[k]


def construct(error: BaseException) -> str:
    """What failed, and where in the user's (or the library's) code: `TypeError: ... at
    modeling_bert.py:85: position_ids = self.position_ids[:, a:b]`."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "/torch/" not in f.filename and f.filename != __file__]  # fmt: skip
    where = ""
    if frames:
        f = frames[-1]
        where = f" at {f.filename.rsplit('/', 1)[-1]}:{f.lineno}: {(f.line or '').strip()}"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}{where}"


class Traced:
    """The model's forward as a graph of its cut candidates, in the order it calls them:
    at least `want` of them where the module tree has them, and every `required` one."""

    def __init__(self, model: nn.Module, want: int = 0, required: Sequence[str] = ()):
        self.model = model
        self.whole: dict[str, str] = {}  # modules kept whole: why their forward did not trace
        with without_cache(model):
            while True:
                leaves = set(candidates(model, want, required, frozenset(self.whole)))
                tracer = _Tracer(model, leaves)
                try:
                    self.graph = tracer.trace(model)
                    break
                except Exception as e:
                    where = tracer.failed_in
                    if not where or where in self.whole:
                        raise CutError(
                            f"cannot trace {type(model).__name__}'s forward between its"
                            f" modules: {construct(e)}"
                        ) from None
                    self.whole[where] = construct(e)
        self.nodes = list(self.graph.nodes)
        # Where each candidate's first call is: a stage beginning there starts at that node.
        self.starts: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if node.op == "call_module" and node.target in leaves:
                self.starts.setdefault(str(node.target), i)
        self.units = sorted(self.starts, key=self.starts.__getitem__)  # in calling order

    def ranges(self, starts: Sequence[str]) -> list[range]:
        """The units of each stage when stage k begins at `starts[k-1]` (refused, saying why,
        unless they are distinct candidates in calling order)."""
        unknown = [s for s in starts if s not in self.starts]
        if unknown:
            inside = [f"{w} is kept whole ({why})" for w, why in self.whole.items()
                      if any(s.startswith(f"{w}.") for s in unknown)]  # fmt: skip
            raise CutError(
                f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not where a"
                f" stage can begin{': ' + '; '.join(inside) if inside else ''}; the"
                f" candidates, in order: {', '.join(self.units)}"
            )
        index = [self.units.index(s) for s in starts]
        if index != sorted(set(index)) or (index and index[0] == 0):
            raise CutError(
                f"split points {list(starts)} must be distinct candidates in the order the"
                f" model calls them, after its first ({self.units[0]}): {', '.join(self.units)}"
            )
        bounds = [0, *index, len(self.units)]
        return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]

    def split(self, starts: Sequence[str]) -> list[fx.GraphModule]:
        """One module per stage: stage 0 from the model's input, stage k from `starts[k-1]`."""
        ranges = self.ranges(starts)  # refuses what cannot be cut, saying why
        bounds = [0, *(self.starts[s] for s in starts), len(self.nodes)]
        stages = []
        for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            try:
                stages.append(self._stage(a, b, last=b == len(self.nodes)))
            except Exception as e:  # the generated code must compile: say which and why
                units = [self.units[i] for i in ranges[k]]
                raise CutError(
                    f"the code generated for stage {k} ({units[0]} .. {units[-1]}) of"
                    f" {type(self.model).__name__} does not compile: {construct(e)}"
                ) from None
        return stages

    def _stage(self, a: int, b: int, last: bool) -> fx.GraphModule:
        """Nodes a..b-1 as a module from the values live at a to those live at b."""
        position = {node: i for i, node in enumerate(self.nodes)}
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        if a == 0:
            inputs = [n for n in self.nodes if n.op == "placeholder"]
        else:
            inputs = self._live(a, position)
        for node in inputs:
            env[node] = graph.placeholder(node.name)
        for node in self.nodes[a:b]:
            if node in env:
                continue
            if node.op == "output":
                graph.output(fx.map_arg(node.args[0], env.__getitem__))
                break
            env[node] = graph.node_copy(node, env.__getitem__)
        if not last:
            graph.output(tuple(env[n] for n in self._live(b, position)))
        module = fx.GraphModule(self.model, graph)
        module.train(self.model.training)
        return module

    def _live(self, at: int, position: dict[fx.Node, int]) -> list[fx.Node]:
        """Values made before node `at` that nodes from `at` on use, in the order made."""
        return [n for n in self.nodes[:at]
                if n.op != "output" and any(position[u] >= at for u in n.users)]  # fmt: skip


def ties(stages: list[nn.Module]) -> list[list[tuple[int, str]]]:
    """Parameters that several stages hold (tied weights, e.g. input and output embeddings):
    per tensor, each (stage, name) holding it. Each stage trains its own copy once shipped,
    so the pipeline sums their gradients (as Megatron does for tied embeddings) and the
    copies, equal at the start and stepped alike, stay equal."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for k, stage in enumerate(stages):
        seen: set[int] = set()
        for name, p in stage.named_parameters(remove_duplicate=False):
            if id(p) not in seen:  # one name per stage: its copy of the tensor
                seen.add(id(p))
                holders.setdefault(id(p), []).append((k, name))
    return [h for h in holders.values() if len(h) > 1]


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a value a stage passes on or a model returns: a tensor, or a tuple,
    list or dict (a ModelOutput too) holding them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    return []


def join(outputs: list[Any]) -> Any:
    """Micro-batches' outputs as the whole batch's: a tensor, or a tuple, list or dict (a
    Hugging Face ModelOutput too) of them."""
    if isinstance(outputs[0], tuple | list):
        return type(outputs[0])(join(list(part)) for part in zip(*outputs, strict=True))
    if isinstance(outputs[0], dict):
        return type(outputs[0])(**{k: join([o[k] for o in outputs]) for k in outputs[0]})
    return torch.cat(outputs)


def cut_count_error(units: int, stages: int) -> CutError:
    return CutError(f"the model has {units} places to cut; it can fill at most {units} stages,"
                    f" not {stages}")  # fmt: skip


def unused(model: nn.Module, stages: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The model's state no stage holds (parameters its forward never uses): the output
    keeps them as they are, so the model loads whole."""
    held = {k for stage in stages for k in stage.state_dict()}
    return {k: v for k, v in model.state_dict().items() if k not in held}
