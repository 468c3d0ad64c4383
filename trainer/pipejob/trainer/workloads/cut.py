"""Any model cut into pipeline stages at module names, keeping the original parameter names.

Cut candidates come from the module tree: the model's children, with plain `Sequential` and
`ModuleList` containers opened into their items. torch.fx traces the model's forward with
every candidate as a leaf, so only the glue between candidates must be traceable (a
candidate's own forward may hold any Python). The graph is then cut where stages begin:
each stage is a GraphModule made from the original model, so its parameters and buffers keep
their original names (`layer3.0.conv1.weight`), and the stages' state dicts together are the
model's. Whatever the forward carries across a cut (one tensor or several: a residual
stream, a mask, a size) is passed on: stage k takes the values live at its start as
positional arguments and returns those live at its end, as a tuple; the last stage returns
the model's output.

Why not torch.distributed.pipelining's tracer (torch.export): it bakes training mode into
the graph (a BatchNorm in `.eval()` still updates its statistics, measured), its stages do
not pickle, and tracing ResNet-18 takes 1.4 s against fx's 0.02 s."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import fx, nn

CONTAINERS = (nn.Sequential, nn.ModuleList)


class CutError(ValueError):
    """The model cannot be cut as asked: the message says why and what can be done."""


def candidates(model: nn.Module) -> list[str]:
    """Module names where a stage may begin, in the module tree's order."""

    def walk(prefix: str, module: nn.Module) -> list[str]:
        found = []
        for name, child in module.named_children():
            if type(child) in CONTAINERS:  # plain containers only: subclasses are units
                found += walk(f"{prefix}{name}.", child)
            else:
                found.append(f"{prefix}{name}")
        return found

    return walk("", model)


class _Tracer(fx.Tracer):
    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)


class Traced:
    """The model's forward as a graph of its cut candidates, in the order it calls them."""

    def __init__(self, model: nn.Module):
        self.model = model
        leaves = set(candidates(model))
        try:
            self.graph = _Tracer(leaves).trace(model)
        except Exception as e:
            raise CutError(
                f"cannot trace {type(model).__name__}'s forward between its modules"
                f" ({type(e).__name__}: {e}); the code that calls its top-level modules must"
                " not branch on tensor values"
            ) from None
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
            raise CutError(
                f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not where a"
                f" stage can begin; the candidates, in order: {', '.join(self.units)}"
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
        self.ranges(starts)  # refuses what cannot be cut, saying why
        bounds = [0, *(self.starts[s] for s in starts), len(self.nodes)]
        stages = [self._stage(a, b, last=b == len(self.nodes))
                  for a, b in zip(bounds, bounds[1:], strict=False)]  # fmt: skip
        _refuse_shared(stages)
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
            env[node] = graph.placeholder(node.name, default_value=_default(node))
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


def _default(node: fx.Node) -> object:
    """A model input's default (forward(x, mask=None)), kept for stage 0's caller. Types
    are not kept: a string annotation (`from __future__ import annotations`) does not
    pickle."""
    if node.op == "placeholder" and node.args:
        return node.args[0]
    return inspect.Signature.empty


def _refuse_shared(stages: list[fx.GraphModule]) -> None:
    """A parameter two stages use (tied weights) would be trained apart as two copies."""
    owner: dict[int, tuple[int, str]] = {}
    for k, stage in enumerate(stages):
        for name, tensor in stage.state_dict(keep_vars=True).items():
            first = owner.setdefault(id(tensor), (k, name))
            if first[0] != k:
                raise CutError(
                    f"{first[1]} (stage {first[0]}) and {name} (stage {k}) are one tensor"
                    " (tied weights): choose splitPoints that keep its users in one stage"
                )


def cut_count_error(units: int, stages: int) -> CutError:
    return CutError(f"the model has {units} places to cut; it can fill at most {units} stages,"
                    f" not {stages}")  # fmt: skip


def unused(model: nn.Module, stages: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The model's state no stage holds (parameters its forward never uses): the output
    keeps them as they are, so the model loads whole."""
    held = {k for stage in stages for k in stage.state_dict()}
    return {k: v for k, v in model.state_dict().items() if k not in held}
