"""Which of the model's submodules live on which stage on the eager path: the modules the
forward calls (outermost first, the costliest opened into its children while there are fewer
than two per stage), in the order they first run, split among the stages by their measured
forward cost with the balanced cut's min-max split (pipeline/balance.py); under
spec.deterministic by their counted cost (pipeline/counted_cost.py), so that every run of one
manifest places them alike."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from pipejob.trainer.pipeline.balance import min_max_partition
from pipejob.trainer.pipeline.counted_cost import count_call

# Units wanted per stage before the costliest is opened no further (as the traced cut's
# CANDIDATES_PER_STAGE): enough for the min-max split to balance.
UNITS_PER_STAGE = 2
# How often the forward is run to find the units (each run may open one module).
MAX_OPENINGS = 64
# Why the one-process check keeps a module with the glue (check.py); the forwards then run
# one at a time (Placement.one_at_a_time).
CHANGES_STATE = (
    "gives another result called through a copy, as a stage calls it (its forward"
    " changes Python state that the glue reads)"
)


@dataclass
class Placement:
    """Per stage, the names of the modules it holds, in the order the forward first calls
    them; each module's measured forward seconds (or, `counted`, its counted cost); the
    modules kept with the master's glue, with why; the other names of a placed module
    registered under more than one."""

    stages: list[list[str]]
    costs: dict[str, float]
    kept: dict[str, str] = field(default_factory=dict)
    also: dict[str, list[str]] = field(default_factory=dict)
    counted: bool = False

    def one_at_a_time(self) -> bool:
        """Whether the micro-batches' forwards must run one at a time, in order: a module
        kept with the glue changes Python state that the glue reads (DynUNet's heads), which
        forwards at once would overwrite for each other."""
        return CHANGES_STATE in self.kept.values()

    def stage_of(self) -> dict[str, int]:
        return {name: i for i, names in enumerate(self.stages) for name in names}

    def remote(self) -> list[str]:
        return [name for names in self.stages for name in names]


def record_calls(
    model: nn.Module,
    run: Callable[[], object],
    names: list[str],
    called: set[str] | None = None,
    counted: bool = False,
) -> list[tuple[str, float]]:
    """Each call that `run()` makes of the modules `names` (the model's own names) outside a
    call of another of them, in order, with its seconds (`counted`: its counted cost, the
    same on any machine); `called` gets every name called, inside another's call too."""
    active: list[tuple[str, float]] = []
    calls: list[tuple[str, float]] = []
    inputs: list[tuple[str, Any, Any]] = []  # counted: each call's, counted after the run
    called = set() if called is None else called
    handles = []

    def before(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            called.add(name)
            if counted and not active:  # copies: the glue may change them in place after
                inputs.append((name, *tree_map_only(torch.Tensor, torch.clone, (args, kwargs))))
            active.append((name, time.perf_counter()))

        return hook

    def after(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            own, start = active.pop()
            if not active:  # a call inside another unit's runs where that unit does
                calls.append((own, time.perf_counter() - start))

        return hook

    for name in names:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(before(name), with_kwargs=True))
        handles.append(module.register_forward_hook(after(name)))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return counted_calls(model, inputs) if counted else calls


def counted_calls(model: nn.Module, inputs: list[tuple[str, Any, Any]]) -> list[tuple[str, float]]:
    """Each recorded call (a module's name, its inputs) with its counted cost, on a copy of
    the module (so BatchNorm's statistics and the gradients stay the model's)."""
    copies: dict[str, nn.Module] = {}
    calls = []
    for name, args, kwargs in inputs:
        if name not in copies:
            copies[name] = copy.deepcopy(model.get_submodule(name))
        try:
            calls.append((name, count_call(copies[name], args, kwargs)))
        except Exception as e:  # a forward that needs what the glue set just before it
            raise ValueError(
                f"spec.deterministic: {name} cannot be counted (called again on a copy of the"
                f" inputs the forward gave it, it raised {type(e).__name__}: {e}); leave"
                " spec.deterministic out to place the modules by timing"
            ) from e
    return calls


def children(model: nn.Module, opened: set[str]) -> list[str]:
    """The units: the children of the opened modules that are not opened themselves, in the
    module tree's order."""
    units, seen = [], {id(model.get_submodule(n)) for n in opened}
    for name, module in model.named_modules():
        if name in opened:
            for c, child in module.named_children():
                # A module under two names (DynUNet's skip layers hold its blocks) is one unit.
                if id(child) not in seen:
                    seen.add(id(child))
                    units.append(f"{name}.{c}" if name else c)
    return units


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def measured_units(
    model: nn.Module, run: Callable[[], object], stages: int, counted: bool = False
) -> tuple[list[str], dict[str, float]]:
    """The units the forward calls that hold parameters, in the order they first run, and
    their forward seconds (`counted`: their counted cost; every call added); the costliest
    opened while there are fewer than UNITS_PER_STAGE per stage and it has children that
    hold parameters."""
    opened = {""}
    for _ in range(MAX_OPENINGS):
        costs: dict[str, float] = {}
        candidates = children(model, opened)
        called: set[str] = set()
        for name, seconds in record_calls(model, run, candidates, called, counted):
            costs[name] = costs.get(name, 0.0) + seconds
        # A container the forward never calls (a ModuleList) opens into the items it calls.
        containers = {
            u
            for u in candidates
            if u not in called
            and any(_holds_parameters(c) for c in model.get_submodule(u).children())
        }
        if containers:
            opened |= containers
            continue
        units = [u for u in costs if _holds_parameters(model.get_submodule(u))]
        openable = [
            u for u in units if any(_holds_parameters(c) for c in model.get_submodule(u).children())
        ]
        if len(units) >= UNITS_PER_STAGE * stages or not openable:
            return units, {u: costs[u] for u in units}
        opened.add(max(openable, key=lambda u: costs[u]))
    return units, {u: costs[u] for u in units}


def place(
    model: nn.Module,
    run: Callable[[], object],
    stages: int,
    keep: dict[str, str] | None = None,
    counted: bool = False,
) -> Placement:
    """The placement of the model's costly modules on `stages` stages (`run()`: one forward
    of a micro-batch), but the modules `keep` (with why), by their measured forward seconds
    or (`counted`: spec.deterministic) their counted cost. A module sharing a parameter with
    the glue stays with the glue; two sharing one live on the first one's stage (a parameter
    lives in one place)."""
    units, costs = measured_units(model, run, stages, counted)
    kept = dict(keep or {})
    units = [u for u in units if u not in kept]
    kept |= shared_with_glue(model, units)
    units = [u for u in units if u not in kept]
    if len(units) < stages:
        raise ValueError(
            f"the forward calls {len(units)} module(s) with parameters of their own"
            f" ({', '.join(units) or 'none'}): too few for {stages} stages"
        )
    ranges = min_max_partition([costs[u] for u in units], stages)
    stage = {u: i for i, r in enumerate(ranges) for u in (units[k] for k in r)}
    owner: dict[int, int] = {}  # a parameter's id -> the stage of the first unit using it
    for u in units:
        ids = [id(p) for p in model.get_submodule(u).parameters()]
        first = [owner[i] for i in ids if i in owner]
        if first:
            stage[u] = first[0]
        for i in ids:
            owner.setdefault(i, stage[u])
    placed = [[u for u in units if stage[u] == i] for i in range(stages)]
    also = {u: others for u in units if (others := aliases(model, u)[1:])}
    return Placement(placed, {u: costs[u] for u in units}, kept, also, counted)


def shared_with_glue(model: nn.Module, units: list[str]) -> dict[str, str]:
    """The units sharing a parameter with what stays on the master (its own parameters, and
    modules that are no unit), with why."""
    inside = {id(p) for u in units for p in model.get_submodule(u).parameters()}
    # By the modules themselves, not their names: a module may be named twice.
    unit_modules = {id(m) for u in units for m in model.get_submodule(u).modules()}
    glue = set()
    for module in model.modules():
        if id(module) not in unit_modules:
            glue |= {id(p) for p in module.parameters(recurse=False)}
    glue &= inside
    return {
        u: "shares a parameter with the master's glue"
        for u in units
        if any(id(p) in glue for p in model.get_submodule(u).parameters())
    }


def aliases(model: nn.Module, name: str) -> list[str]:
    """Every name the module `name` is reachable under in `model` (DynUNet registers
    input_block again as skip_layers.downsample), `name` first."""
    module = model.get_submodule(name)
    others = [n for n, m in model.named_modules(remove_duplicate=False) if m is module]
    return [name, *(n for n in others if n != name)]


def replace(model: nn.Module, name: str, by: nn.Module) -> dict[str, nn.Module]:
    """The module `name` replaced by `by` under every name it has (one module, one place):
    what each name held, to put back with `restore`."""
    held = {}
    for alias in aliases(model, name):
        parent, _, child = alias.rpartition(".")
        holder = model.get_submodule(parent)
        held[alias] = holder._modules[child]
        holder._modules[child] = by
    return held


def restore(model: nn.Module, held: dict[str, nn.Module]) -> None:
    """The modules `replace` took out, put back under their names."""
    for alias, module in held.items():
        parent, _, child = alias.rpartition(".")
        model.get_submodule(parent)._modules[child] = module


def under_every_name(
    state: dict[str, torch.Tensor], also: dict[str, list[str]]
) -> dict[str, torch.Tensor]:
    """A stage's state (by its modules' first names) with each entry also under the other
    names of its module, as the model's own state_dict has it."""
    named = dict(state)
    for name, others in also.items():
        for key, value in state.items():
            if key.startswith(f"{name}."):
                named |= {f"{other}{key[len(name) :]}": value for other in others}
    return named


def describe(placement: Placement) -> list[str]:
    """One line per stage: its modules and its share of the measured (or counted) cost."""
    total = sum(placement.costs.values()) or 1.0
    how = "counted" if placement.counted else "measured"
    return [
        f"stage {i}: {', '.join(names)} ({sum(placement.costs[n] for n in names) / total:.0%}"
        f" of {how} cost)"
        for i, names in enumerate(placement.stages)
    ]


def no_grad_run(model: nn.Module, inputs: object) -> Callable[[], object]:
    """One forward of `inputs` without autograd, as the placement measures it."""

    def run() -> object:
        with torch.no_grad():
            return model(inputs)

    return run
