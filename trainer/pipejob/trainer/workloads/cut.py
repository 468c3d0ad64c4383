"""Any model cut into pipeline stages at module names, keeping the original parameter names:
cut candidates from the module tree, fx's trace of the forward with them as leaves
(workloads/tracing.py), the graph cut into `Piece`s (workloads/piece.py), and the parameters
two stages share (`ties`). How and why (the candidates, both modes traced, what crosses a
cut, why not torch.export): docs/architecture.md, "How any model is cut"."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from pipejob.trainer.workloads import batch_values
from pipejob.trainer.workloads.model_guards import read_from_python_state, unchanged, without_cache
from pipejob.trainer.workloads.piece import Piece, attach
from pipejob.trainer.workloads.refusals import construct, kept_whole, reads_python_state, way_past
from pipejob.trainer.workloads.shapes import ShapedTracer
from pipejob.trainer.workloads.tracing import Objects, Tracer, materialize_masks, place_parameters

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
# Modules never opened: in evaluation without gradients their forward picks a fused kernel
# when its arguments are not traced, so a traced copy of it would run another kernel (and
# other roundings) than the model does.
FUSED_AT_RUN_TIME = (nn.MultiheadAttention, nn.TransformerEncoderLayer)


class CutError(ValueError):
    """The model cannot be cut as asked: the message says why and what can be done."""


def candidates(
    model: nn.Module,
    want: int = 0,
    required: Sequence[str] = (),
    whole: frozenset[str] = frozenset(),
) -> list[str]:
    """Module names where a stage may begin, in the module tree's order: the model's
    children, then the modules above each `required` name opened, then the largest
    candidate opened (most parameters; the first on a tie) while there are fewer than
    `want`. Modules in `whole` (their forward does not trace) and FUSED_AT_RUN_TIME are never
    opened."""
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
        module = modules[name]
        if name in whole or isinstance(module, FUSED_AT_RUN_TIME):
            return False
        return next(module.children(), None) is not None

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
        graph = fx.Graph(tracer_cls=Objects)
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
        return [
            n
            for n in self.nodes[:at]
            if n.op != "output" and any(self.position[u] >= at for u in n.users)
        ]

    def code(self) -> str:
        return self.graph.python_code("self").src


class Traced:
    """The model's forward as a graph of its cut candidates, in the order it calls them:
    at least `want` of them where the module tree has them, and every `required` one.

    fx records what the forward does in one mode: a branch on `self.training` (Inception's
    auxiliary head, a functional dropout) is decided while tracing. So the forward is traced
    in training mode and in evaluation mode; where the two differ, each stage holds both
    (`Piece`), and the candidates are those both call."""

    def __init__(
        self,
        model: nn.Module,
        want: int = 0,
        required: Sequence[str] = (),
        sample: torch.Tensor | Callable[[], torch.Tensor] | None = None,
    ):
        self.model = model
        self.whole: dict[str, str] = {}  # modules kept whole: why their forward did not trace
        self.shaped = False  # traced with the shapes of `sample` (workloads/shapes.py)
        with without_cache(model):
            graphs, leaves = self._traced(want, required, sample)
        self.forward = _Forward(graphs[0], leaves)  # training's
        evaluation = _Forward(graphs[1], leaves)
        self.evaluation = None if evaluation.code() == self.forward.code() else evaluation
        both = [
            u for u in self.forward.starts if self.evaluation is None or u in self.evaluation.starts
        ]
        self.units = sorted(both, key=self.forward.starts.__getitem__)  # in calling order
        if self.evaluation is not None:
            order = sorted(self.units, key=self.evaluation.starts.__getitem__)
            self.units = [u for u, v in zip(self.units, order, strict=True) if u == v]

    def _traced(
        self,
        want: int,
        required: Sequence[str],
        sample: torch.Tensor | Callable[[], torch.Tensor] | None,
    ) -> tuple[list[fx.Graph], set[str]]:
        """The graphs of training's and evaluation's forward, and their leaves: traced as
        fx traces; where that fails or keeps a module whole and the job's input is known
        (`sample`, or what gives it: read only then), traced again with its shapes
        (ShapedTracer), kept if that does better."""
        try:
            found, error = self._trace(want, required, None), None
        except CutError as e:
            found, error = None, e
        if sample is None or (found is not None and not self.whole):
            if found is None:
                raise error  # type: ignore[misc]
            return found
        sample = sample() if callable(sample) else sample
        if not isinstance(sample, torch.Tensor):  # a dict of inputs: no shapes to trace with
            if found is None:
                raise error  # type: ignore[misc]
            return found
        plain = self.whole
        self.whole = {}
        try:
            shaped = self._trace(want, required, sample)
        except CutError:
            if found is None:
                raise
            self.whole = plain
            return found
        self.shaped = True
        return shaped

    def _trace(
        self, want: int, required: Sequence[str], sample: torch.Tensor | None
    ) -> tuple[list[fx.Graph], set[str]]:
        """One way of tracing (with `sample`'s shapes or without), keeping whole each module
        whose forward does not trace, until the rest does (or refusing, saying why)."""
        model, training = self.model, self.model.training
        while True:
            leaves = set(candidates(model, want, required, frozenset(self.whole)))
            shaped = sample is not None
            tracer = ShapedTracer(model, leaves, sample) if shaped else Tracer(model, leaves)
            try:
                graphs, flags = [], {}
                for mode in (True, False):
                    model.train(mode)
                    with unchanged(model, flags if shaped else None):
                        graphs.append(tracer.trace(model))
                    self._python_state(graphs[-1])
                    materialize_masks(graphs[-1])
                    place_parameters(graphs[-1], model)
                if not flags:
                    return graphs, leaves
                self._keep_whole_for(flags, leaves)
            except CutError:
                raise
            except Exception as e:
                self._python_state(getattr(tracer, "graph", None))  # why it failed, if read
                where = tracer.failed_in
                if not where or where in self.whole:
                    kept = "".join(
                        f"; {w} is kept whole, as {why}" for w, why in self.whole.items()
                    )
                    raise CutError(
                        f"cannot trace {type(model).__name__}'s forward between its"
                        f" modules: {construct(e)}{kept}; {way_past(where or '')}"
                    ) from None
                self.whole[where] = construct(e)
            finally:
                model.train(training)

    def _python_state(self, graph: fx.Graph | None) -> None:
        """Refuse a trace that read, as a constant, what a forward writes in Python state."""
        if graph is not None and (read := read_from_python_state(graph, self.model)):
            raise CutError(reads_python_state(type(self.model).__name__, read))

    def _keep_whole_for(self, flags: dict[nn.Module, str], leaves: set[str]) -> None:
        """A forward that switched a module's setting by the shapes it saw (the trace ran
        the branch a plain first call runs, but puts the setting back): the outermost such
        module (its parent, where it is a unit already) kept whole, so its forward runs,
        switch and all, in its stage."""
        names = {m: n for n, m in self.model.named_modules()}
        changed = min((names[m] for m in flags if m in names), key=lambda n: n.count("."))
        setting = f"{changed}.{flags[self.model.get_submodule(changed)]}".lstrip(".")
        name = changed.rpartition(".")[0] if changed in leaves else changed
        why = f"its forward changes a setting by the input's shape ({setting})"
        if not name or name in self.whole:
            raise CutError(
                f"cannot trace {type(self.model).__name__}'s forward between its"
                f" modules: {why}; {way_past(name)}"
            )
        self.whole[name] = why

    @property
    def graph(self) -> fx.Graph:
        return self.forward.graph

    def ranges(self, starts: Sequence[str]) -> list[range]:
        """The units of each stage when stage k begins at `starts[k-1]` (refused, saying why,
        unless they are distinct candidates in calling order)."""
        unknown = [s for s in starts if s not in self.units]
        if unknown:
            inside = [
                f"{w} is kept whole ({why})"
                for w, why in self.whole.items()
                if any(s.startswith(f"{w}.") for s in unknown)
            ]
            raise CutError(
                f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not where a"
                f" stage can begin{': ' + '; '.join(inside) if inside else ''}; the"
                f" candidates, in order: {', '.join(self.units)}"
                + (f"; {way_past()}" if inside else "")
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
                attach(stages[first[id(p)]], name, p)


def ties(stages: list[nn.Module]) -> list[list[tuple[int, str]]]:
    """Parameters that several stages hold (tied weights, e.g. input and output embeddings):
    per tensor, each (stage, name) holding it. Each stage trains its own copy once shipped,
    so the pipeline sums their gradients (as Megatron does for tied embeddings) and the
    copies, equal at the start and stepped alike, stay equal. A frozen one (LoRA over a
    tied embedding) is no tie: nothing steps its copies, and no stage has its gradient."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for k, stage in enumerate(stages):
        seen: set[int] = set()
        for name, p in stage.named_parameters(remove_duplicate=False):
            if id(p) not in seen and p.requires_grad:  # one name per stage: its copy
                seen.add(id(p))
                holders.setdefault(id(p), []).append((k, name))
    return [h for h in holders.values() if len(h) > 1]


def join(outputs: list[Any]) -> Any:
    """Micro-batches' outputs as the whole batch's: a tensor, or a tuple, named tuple, list
    or dict (a Hugging Face ModelOutput too) of them. Only values with a batch dimension are
    concatenated; a value beside the batch is carried as the micro-batches computed it
    (batch_values.beside), never concatenated."""
    sizes = [batch_values.samples(o, dim_only=True) for o in outputs]
    return _join(outputs, sizes)


def _join(outputs: list[Any], sizes: list[int]) -> Any:
    if isinstance(outputs[0], tuple | list):
        parts = [_join(list(part), sizes) for part in zip(*outputs, strict=True)]
        kind = type(outputs[0])
        return kind._make(parts) if hasattr(kind, "_make") else kind(parts)  # type: ignore
    if isinstance(outputs[0], dict):
        return type(outputs[0])(**{k: _join([o[k] for o in outputs], sizes) for k in outputs[0]})
    if isinstance(outputs[0], torch.Tensor) and outputs[0].dim():
        return torch.cat(outputs)
    return batch_values.beside(outputs, sizes)


def cut_count_error(units: int, stages: int, whole: dict[str, str] | None = None) -> CutError:
    """Too few places to cut: and, where modules were kept whole, which and why (the line
    of the model's source), and the way past."""
    why = f"{kept_whole(whole)}; {way_past()}" if whole else ""
    return CutError(
        f"the model has {units} places to cut; it can fill at most {units} stages,"
        f" not {stages}{why}"
    )


def state_names(module: nn.Module) -> list[str]:
    """The names of a stage's parameters and buffers: what the process holding it builds
    (workloads/materialize.py)."""
    return [
        *(n for n, _ in module.named_parameters(remove_duplicate=False)),
        *(n for n, _ in module.named_buffers(remove_duplicate=False)),
    ]


def unused(model: nn.Module, stages: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The model's state no stage holds (parameters its forward never uses): the output
    keeps them as they are, so the model loads whole."""
    held = {k for stage in stages for k in stage.state_dict()}
    return {k: v for k, v in model.state_dict().items() if k not in held}
