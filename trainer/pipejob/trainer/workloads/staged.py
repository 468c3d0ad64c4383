"""A model the user stages, past the tracer (spec.model.staged): `layers` (DeepSpeed's
PipelineModule: these modules called in turn) or `stage` (torchtitan's and Megatron's way: a
function that builds stage i of n, in that stage's process only). `Layers` and `Built` have
cut.Traced's `units`, `ranges` and `split`, so everything after the cut is the same code
(pipeline/stage_build.py dispatches). What users write: docs/user-guide.md, "Past the
tracer: `model.staged`"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.workloads import cut, imports, materialize

_STATE = ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set")


def chain(layers: Sequence[nn.Module], x: tuple[Any, ...]) -> Any:
    """`layers` called in turn, each with what the previous returned; the last's output."""
    out: Any = None
    for layer in layers:
        out = layer(*x)
        x = out if type(out) is tuple else (out,)
    return out


def passed(out: Any, last: bool) -> Any:
    """What a stage returns: the model's output on the last, else a tuple of values the
    next stage takes as positional arguments."""
    return out if last or type(out) is tuple else (out,)


class Chain(nn.Sequential):
    """Modules called one after another, each with what the previous returned: a model
    staged by `stage` without a whole model (its names are `0.`, `1.`, ...)."""

    def forward(self, *x: Any) -> Any:  # type: ignore[override]
        return chain(list(self), x)


class Run(nn.Module):
    """Consecutive layers of a staged model, held under the model's own names (plain
    modules on the way, as cut.Piece holds them)."""

    def __init__(self, model: nn.Module, names: Sequence[str], last: bool):
        super().__init__()
        layers = [model.get_submodule(name) for name in names]
        for name, layer in zip(names, layers, strict=True):
            *path, attr = name.split(".")
            holder: nn.Module = self
            for part in path:
                if part not in holder._modules:
                    holder.add_module(part, nn.Module())
                holder = holder._modules[part]  # type: ignore[assignment]
            holder.add_module(attr, layer)
        self.__dict__["layers"] = layers  # not submodules: no second names
        self.last = last

    def forward(self, *x: Any) -> Any:
        return passed(chain(self.__dict__["layers"], x), self.last)


class Adopted(nn.Module):
    """A module the user's stage function built, holding its state under its own names
    (shared with it, as cut.Piece shares a GraphModule's), passing on a tuple unless last."""

    def __init__(self, module: nn.Module, last: bool):
        super().__init__()
        for key in _STATE:
            self.__dict__[key] = module.__dict__[key]
        self.__dict__["module"] = module
        self.last = last

    def train(self, mode: bool = True) -> Adopted:
        self.__dict__["module"].train(mode)  # its own forward reads its own flag
        return super().train(mode)

    def forward(self, *x: Any) -> Any:
        return passed(self.__dict__["module"](*x), self.last)


class Layers:
    """The model cut only between the modules `layers` names (spec.model.staged.layers)."""

    whole: dict[str, str] = {}  # as cut.Traced's: no module is kept whole here
    ranges = cut.Traced.ranges  # the same refusals of split points

    def __init__(self, model: nn.Module, layers: Sequence[str]):
        self.model = model
        self.units = units(model, layers)

    def split(self, starts: Sequence[str]) -> list[nn.Module]:
        ranges = self.ranges(starts)
        return [
            Run(self.model, [self.units[i] for i in r], k == len(ranges) - 1)
            for k, r in enumerate(ranges)
        ]


def units(model: nn.Module, layers: Sequence[str]) -> list[str]:
    """The modules `layers` names, a plain container opened into its items; refused, naming
    spec.model.staged.layers, where a name is not a module of the model, or is inside
    another."""
    modules = dict(model.named_modules())
    found: list[str] = []
    for name in layers:
        if name not in modules or name == "":
            children = ", ".join(n for n, _ in model.named_children())
            raise cut.CutError(
                f"spec.model.staged.layers: {name!r} is not a module of"
                f" {type(model).__name__} (its children: {children})"
            )
        found += _opened(name, modules[name])
    for a in found:
        inside = [b for b in found if a == b or a.startswith(f"{b}.")]
        if len(inside) > 1:
            raise cut.CutError(
                f"spec.model.staged.layers: {a} is named twice or inside"
                f" {inside[-1] if inside[-1] != a else inside[0]}"
            )
    return found


def _opened(name: str, module: nn.Module) -> list[str]:
    if type(module) not in cut.CONTAINERS:
        return [name]
    return [n for child, m in module.named_children() for n in _opened(f"{name}.{child}", m)]


class Built:
    """The model as the user's stage function builds it (spec.model.staged.stage): one
    unit per piece. On the master, `split` builds every piece on the meta device (names and
    sizes only); a stage process builds its own with `build`."""

    whole: dict[str, str] = {}
    ranges = cut.Traced.ranges

    def __init__(self, spec: PipelineSpec, model: nn.Module):
        self.spec, self.model = spec, model
        function = str(spec.model.staged.stage).rpartition(":")[2]  # type: ignore[union-attr]
        self.units = [f"{function}({i})" for i in range(spec.pieces)]

    def split(self, starts: Sequence[str]) -> list[nn.Module]:
        self.ranges(starts)  # one unit per piece: refuses other split points
        if self.spec.model.import_ is None:  # the model is the Chain of the stages
            return [
                Run(self.model, [str(i)], i == len(self.units) - 1) for i in range(len(self.units))
            ]
        names = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        names |= {n for n, _ in self.model.named_buffers(remove_duplicate=False)}
        stages = []
        for i in range(len(self.units)):
            built, _ = materialize.build(lambda i=i: stage(self.spec, i), ())
            unknown = sorted(set(cut.state_names(built)) - names)
            if unknown:
                raise cut.CutError(
                    f"spec.model.staged.stage: stage {i} holds {', '.join(unknown[:3])}, which"
                    f" {self.spec.model.import_} does not: a stage must hold its parameters"
                    " under the whole model's names (build it and keep its modules), or"
                    " leave model.import out"
                )
            stages.append(Adopted(built, i == len(self.units) - 1))
        return stages


def stage(spec: PipelineSpec, i: int) -> nn.Module:
    """Stage `i` of spec.pieces from the user's function, under spec.seed."""
    assert spec.model.staged is not None and spec.model.staged.stage is not None
    torch.manual_seed(spec.seed)
    path = spec.model.staged.stage
    return imports.module(
        path, "spec.model.staged.stage", spec.model.args, stage=i, stages=spec.pieces
    )


def whole(spec: PipelineSpec) -> Chain:
    """The model of a `stage` function without `import`: its stages in order."""
    return Chain(*(stage(spec, i) for i in range(spec.pieces)))


def build(spec: PipelineSpec, pieces: Sequence[int]) -> list[nn.Module]:
    """Runs on a stage process: the pieces `pieces` of a model the user's stage function
    builds, each built alone (only its parameters exist)."""
    built: list[nn.Module] = []
    for i in pieces:
        last = i == spec.pieces - 1
        module = stage(spec, i)
        if spec.model.import_ is None:
            holder = Chain()
            holder.add_module(str(i), module)
            built.append(Run(holder, [str(i)], last))
        else:
            built.append(Adopted(module, last))
    return built


def builds(spec: PipelineSpec) -> bool:
    """Whether the user's function builds the stages (spec.model.staged.stage)."""
    return spec.model.staged is not None and spec.model.staged.stage is not None


def as_traced(spec: PipelineSpec, model: nn.Module) -> Layers | Built:
    """The staged model's units and cut (spec.model.staged), as cut.Traced gives them."""
    staged = spec.model.staged
    assert staged is not None
    if staged.stage is not None:
        return Built(spec, model)
    return Layers(model, staged.layers)


def as_called(spec: PipelineSpec, model: nn.Module) -> nn.Module:
    """The staged model as the pipeline calls it (its pieces in turn), for the master's fit
    check: its own forward is not what runs."""
    staged = as_traced(spec, model)
    return Chain(*staged.split(staged.units[1:]))
