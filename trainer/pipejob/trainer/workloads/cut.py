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


class _Objects(fx.Tracer):
    """fx's tracer keeping the objects a forward passes to calls as they are: a Hugging Face
    ModelOutput is rebuilt as itself (fx would make a plain dict of it, and the loss gets
    what the model returns), and any other dataclass that holds nothing traced (a Hugging
    Face config given to a mask builder) is the object itself, held by the stage: fx would
    rebuild it from its fields, losing what is not a field (the config's attention kind,
    which decides the mask: a Mistral's sliding window was lost so). A stage's graph names
    this tracer, so a pickled stage, traced again from its code, keeps them too."""

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, dict) and dataclasses.is_dataclass(a):
            fields = {k: self.create_arg(v) for k, v in a.items()}
            node = self.create_node("call_function", type(a), (), fields)
            node.meta["is_wrapped"] = True
            return node
        if dataclasses.is_dataclass(a) and not isinstance(a, type) and not _traced(a):
            held = next((k for k, v in vars(self.root).items() if v is a), None)
            if held is None:
                held = self.get_fresh_qualname(f"_{type(a).__name__}_constant_")
                setattr(self.root, held, a)
            return self.create_node("get_attr", held, (), {})
        return super().create_arg(a)


class _Tracer(_Objects):
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
        self.opened = {name.rsplit(".", i)[0] for name in leaves
                       for i in range(1, name.count(".") + 1)}  # fmt: skip
        self.failed_in: str | None = None  # "" for the model's own forward

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.opened:
            return False
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


def _traced(value: Any) -> bool:
    """Whether a value holds a traced value (a Proxy) anywhere in its containers."""
    if isinstance(value, fx.Proxy):
        return True
    if isinstance(value, tuple | list | set | frozenset):
        return any(_traced(v) for v in value)
    if isinstance(value, dict):
        return any(_traced(v) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_traced(getattr(value, f.name, None)) for f in dataclasses.fields(value))
    return False


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


class _Forward:
    """One mode's graph of the forward: its nodes, and where each candidate is first called
    (a stage beginning there starts at that node)."""

    def __init__(self, graph: fx.Graph, leaves: set[str]):
        self.graph = graph
        self.nodes = list(graph.nodes)
        self.position = {node: i for i, node in enumerate(self.nodes)}
        self.starts: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if node.op == "call_module" and node.target in leaves:
                self.starts.setdefault(str(node.target), i)

    def piece(self, root: nn.Module, a: int, b: int) -> fx.GraphModule:
        """Nodes a..b-1 as a module from the values live at a to those live at b."""
        graph = fx.Graph(tracer_cls=_Objects)
        env: dict[fx.Node, fx.Node] = {}
        inputs = [n for n in self.nodes if n.op == "placeholder"] if a == 0 else self.live(a)
        for node in inputs:
            env[node] = graph.placeholder(node.name)
        for node in self.nodes[a:b]:
            if node in env:
                continue
            if node.op == "output":
                graph.output(fx.map_arg(node.args[0], env.__getitem__))
                break
            env[node] = graph.node_copy(node, env.__getitem__)
        if b < len(self.nodes):
            graph.output(tuple(env[n] for n in self.live(b)))
        return fx.GraphModule(root, graph)

    def live(self, at: int) -> list[fx.Node]:
        """Values made before node `at` that nodes from `at` on use, in the order made."""
        return [n for n in self.nodes[:at]
                if n.op != "output" and any(self.position[u] >= at for u in n.users)]  # fmt: skip

    def code(self) -> str:
        return self.graph.python_code("self").src


class Traced:
    """The model's forward as a graph of its cut candidates, in the order it calls them:
    at least `want` of them where the module tree has them, and every `required` one.

    fx records what the forward does in one mode: a branch on `self.training` (Inception's
    auxiliary head, a functional dropout) is decided while tracing. So the forward is traced
    in training mode and in evaluation mode; where the two differ, each stage holds both
    (`Piece`), and the candidates are those both call."""

    def __init__(self, model: nn.Module, want: int = 0, required: Sequence[str] = ()):
        self.model = model
        self.whole: dict[str, str] = {}  # modules kept whole: why their forward did not trace
        training = model.training
        with without_cache(model):
            while True:
                leaves = set(candidates(model, want, required, frozenset(self.whole)))
                tracer = _Tracer(model, leaves)
                try:
                    graphs = []
                    for mode in (True, False):
                        model.train(mode)
                        graphs.append(tracer.trace(model))
                    break
                except Exception as e:
                    where = tracer.failed_in
                    if not where or where in self.whole:
                        raise CutError(
                            f"cannot trace {type(model).__name__}'s forward between its"
                            f" modules: {construct(e)}"
                        ) from None
                    self.whole[where] = construct(e)
                finally:
                    model.train(training)
        self.forward = _Forward(graphs[0], leaves)  # training's
        evaluation = _Forward(graphs[1], leaves)
        self.evaluation = None if evaluation.code() == self.forward.code() else evaluation
        both = [u for u in self.forward.starts
                if self.evaluation is None or u in self.evaluation.starts]  # fmt: skip
        self.units = sorted(both, key=self.forward.starts.__getitem__)  # in calling order
        if self.evaluation is not None:
            order = sorted(self.units, key=self.evaluation.starts.__getitem__)
            self.units = [u for u, v in zip(self.units, order, strict=True) if u == v]

    @property
    def graph(self) -> fx.Graph:
        return self.forward.graph

    def ranges(self, starts: Sequence[str]) -> list[range]:
        """The units of each stage when stage k begins at `starts[k-1]` (refused, saying why,
        unless they are distinct candidates in calling order)."""
        unknown = [s for s in starts if s not in self.units]
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

    def split(self, starts: Sequence[str]) -> list[Piece]:
        """One module per stage (a `Piece`): stage 0 from the model's input, stage k from
        `starts[k-1]`."""
        ranges = self.ranges(starts)  # refuses what cannot be cut, saying why
        stages: list[nn.Module] = []
        for k, range_ in enumerate(ranges):
            try:
                stages.append(self._stage(starts, k))
            except Exception as e:  # the generated code must compile: say which and why
                units = [self.units[i] for i in range_]
                raise CutError(
                    f"the code generated for stage {k} ({units[0]} .. {units[-1]}) of"
                    f" {type(self.model).__name__} does not compile: {construct(e)}"
                ) from None
        self._as_the_model(stages)
        return stages

    def _stage(self, starts: Sequence[str], k: int) -> Piece:
        def bounds(forward: _Forward) -> tuple[int, int]:
            at = [0, *(forward.starts[s] for s in starts), len(forward.nodes)]
            return at[k], at[k + 1]

        evaluation = None
        if self.evaluation is not None:
            evaluation = self.evaluation.piece(self.model, *bounds(self.evaluation))
        module = Piece(self.forward.piece(self.model, *bounds(self.forward)), evaluation)
        module.train(self.model.training)
        return module

    def _as_the_model(self, stages: list[Piece]) -> None:
        """The stages hold the model's state as the model does. A buffer the model keeps
        out of its state dict (`persistent=False`) stays out of the stage's, which fx
        registers as persistent. A parameter the model holds under several names of which
        the forward uses only some (T5's `shared` embedding, used as the encoder's, the
        decoder's and the head's) is held under the others too, by the first stage that
        holds it: so the output and the checkpoints have every name of it, trained, and
        none is left behind as it was built."""
        kept = set(self.model.state_dict())
        for stage in stages:
            for name, _ in stage.named_buffers():
                if name not in kept:  # fx's own constants too
                    owner, _, attr = name.rpartition(".")
                    stage.get_submodule(owner)._non_persistent_buffers_set.add(attr)
        first: dict[int, int] = {}  # id of a parameter -> the first stage holding it
        for k, stage in enumerate(stages):
            for p in stage.parameters():
                first.setdefault(id(p), k)
        named = {n for s in stages for n, _ in s.named_parameters(remove_duplicate=False)}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if name not in named and id(p) in first:
                _attach(stages[first[id(p)]], name, p)


_STATE = ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set")


class Piece(nn.Module):
    """A stage's module: the model's forward from where the stage begins to where the next
    begins, as fx's generated code (a GraphModule) run on the model's own modules; and,
    where evaluation runs other code than training, a second one, run in evaluation mode
    (as the model's own forward branches on `self.training`). It holds the state the code
    uses, under the model's names, once: the GraphModules share it, so the piece moves,
    saves, loads and pickles as one module (a GraphModule alone, pickled, would make
    every buffer persistent again)."""

    def __init__(self, training: fx.GraphModule, evaluation: fx.GraphModule | None = None):
        super().__init__()
        if evaluation is not None:
            _merge(training, evaluation)
        for key in _STATE:
            self.__dict__[key] = training.__dict__[key]
        self.__dict__["pieces"] = (training, evaluation)  # not submodules: no second names

    def forward(self, *args: Any) -> Any:
        training, evaluation = self.pieces
        piece = training if self.training or evaluation is None else evaluation
        if piece._modules is not self._modules:  # a copy or an unpickled stage: share again
            for key in _STATE:
                piece.__dict__[key] = self.__dict__[key]
        return piece(*args)

    @property
    def code(self) -> str:
        """The generated code of training's forward (and evaluation's, where it differs)."""
        return "\n".join(p.code for p in self.pieces if p is not None)


def _merge(into: nn.Module, other: nn.Module) -> None:
    """`other`'s modules, parameters and buffers added to `into` where it lacks them (the
    containers fx made for each piece merged), then `other` sharing `into`'s."""
    for name, child in other._modules.items():
        mine = into._modules.get(name)
        if mine is None:
            into._modules[name] = child
        elif mine is not child and child is not None:
            _merge(mine, child)
    for key in ("_parameters", "_buffers"):
        for name, value in getattr(other, key).items():
            getattr(into, key).setdefault(name, value)
    into._non_persistent_buffers_set |= other._non_persistent_buffers_set
    for key in _STATE:
        other.__dict__[key] = into.__dict__[key]


def _attach(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """`param` held by `module` under the dotted `name`, making plain modules on the way."""
    *path, attr = name.split(".")
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    module.register_parameter(attr, param)


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
    """Micro-batches' outputs as the whole batch's: a tensor, or a tuple, named tuple, list
    or dict (a Hugging Face ModelOutput too) of them."""
    if isinstance(outputs[0], tuple | list):
        parts = [join(list(part)) for part in zip(*outputs, strict=True)]
        kind = type(outputs[0])
        return kind._make(parts) if hasattr(kind, "_make") else kind(parts)  # type: ignore
    if isinstance(outputs[0], dict):
        return type(outputs[0])(**{k: join([o[k] for o in outputs]) for k in outputs[0]})
    return torch.cat(outputs)


def cut_count_error(units: int, stages: int) -> CutError:
    return CutError(f"the model has {units} places to cut; it can fill at most {units} stages,"
                    f" not {stages}")  # fmt: skip


def state_names(module: nn.Module) -> list[str]:
    """The names of a stage's parameters and buffers: what the process holding it builds
    (workloads/materialize.py)."""
    return [*(n for n, _ in module.named_parameters(remove_duplicate=False)),
            *(n for n, _ in module.named_buffers(remove_duplicate=False))]  # fmt: skip


def unused(model: nn.Module, stages: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The model's state no stage holds (parameters its forward never uses): the output
    keeps them as they are, so the model loads whole."""
    held = {k for stage in stages for k in stage.state_dict()}
    return {k: v for k, v in model.state_dict().items() if k not in held}
