"""spec.optimizer.groups and layerDecay over a model's parameters: which group each parameter
is in, its weight decay and learning-rate multiplier, and the torch.optim param_groups a
stage (or a HybridJob's trainer) builds over its own parameters, by their names in the whole
model, so that every process puts a parameter where one process's torch.optim would."""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NotRequired, TypedDict

from pipejob.core.optimizer import NO_DECAY, Group, LayerDecay, Optimizer

if TYPE_CHECKING:
    import torch

DEFAULT = "default"  # the group of the parameters no spec group holds


@dataclass(frozen=True)
class ParamPlacement:
    """Where one parameter goes: its group's name, weight decay and lr multiplier."""

    group: str
    weight_decay: float
    lr_scale: float


def _holds(group: Group, name: str, ndim: int) -> bool:
    """Whether `group`'s every condition holds for the parameter `name` of `ndim` dims."""
    if group.preset == NO_DECAY:
        return ndim <= 1 or name == "bias" or name.endswith(".bias")
    if group.params and not any(fnmatch.fnmatchcase(name, p) for p in group.params):
        return False
    return group.max_dims is None or ndim <= group.max_dims


def depth_scale(decay: LayerDecay, name: str) -> float:
    """layerDecay's multiplier of parameter `name`: rate ** (layers - i) in block i, rate **
    (layers + 1) in the stem, 1 elsewhere (timm's param_groups_layer_decay's layer ids)."""
    prefix = decay.blocks + "."
    if name.startswith(prefix):
        index = name[len(prefix) :].split(".", 1)[0]
        if index.isdigit():
            return decay.rate ** (decay.layers - int(index))
    if any(fnmatch.fnmatchcase(name, p) for p in decay.stem):
        return decay.rate ** (decay.layers + 1)
    return 1.0


def place(opt: Optimizer, name: str, ndim: int) -> ParamPlacement:
    """The first group holding the parameter (or the optimizer's own settings)."""
    scale = 1.0 if opt.layer_decay is None else depth_scale(opt.layer_decay, name)
    for group in opt.groups:
        if _holds(group, name, ndim):
            decay = group.weight_decay
            if decay is None:
                decay = 0.0 if group.preset == NO_DECAY else opt.weight_decay
            return ParamPlacement(group.name, decay, group.lr_scale * scale)
    return ParamPlacement(DEFAULT, opt.weight_decay, scale)


class OptimizerArgs(TypedDict):
    """torch.optim's keyword arguments for spec.optimizer (optim.optimizer_args'): the
    momentum of SGD and RMSprop, the betas of Adam and AdamW."""

    lr: float
    weight_decay: float
    momentum: NotRequired[float]
    betas: NotRequired[tuple[float, float]]


class ParamGroup(OptimizerArgs):
    """One of torch.optim's param_groups as we build them: its parameters, the optimizer's
    arguments with the group's own weight_decay and lr, its lr_scale and its name."""

    params: list[torch.Tensor]
    lr_scale: float
    group: str


def param_groups(
    opt: Optimizer, named: Iterable[tuple[str, torch.Tensor]], kwargs: OptimizerArgs
) -> list[ParamGroup]:
    """torch.optim's param_groups over `named` (name, parameter): one per placement, in the
    order their first parameter comes, each with `kwargs` (optimizer_args') but its own
    weight_decay, lr (lr times lr_scale) and lr_scale (which set_lr keeps applying)."""
    groups: dict[ParamPlacement, ParamGroup] = {}
    for name, p in named:
        placed = place(opt, name, p.dim())
        if placed not in groups:
            groups[placed] = {  # torch keeps a group's keys in this order
                "params": [],
                **kwargs,
                "weight_decay": placed.weight_decay,
                "lr": kwargs["lr"] * placed.lr_scale,
                "lr_scale": placed.lr_scale,
                "group": placed.group,
            }
        groups[placed]["params"].append(p)
    return list(groups.values())


def counts(opt: Optimizer, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Per group name, how many parameter elements it holds: the summary's figure."""
    out: Counter[str] = Counter()
    for name, p in named:
        out[place(opt, name, p.dim()).group] += p.numel()
    return dict(out)


def check_ties(opt: Optimizer, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse groups that place one tensor's names (a tied weight's: `named` with duplicates,
    named_parameters(remove_duplicate=False)) apart: the stages holding its copies would step
    them differently, where one process steps it once, under its first name."""
    names: dict[int, list[str]] = {}
    for name, p in named:
        names.setdefault(id(p), []).append(name)
        if len(names[id(p)]) > 1 and place(opt, name, p.dim()) != place(
            opt, names[id(p)][0], p.dim()
        ):
            first = names[id(p)][0]
            raise ValueError(
                f"spec.optimizer.groups: {first} and {name} are one tied parameter, but the"
                f" groups (or layerDecay) place them apart ({place(opt, first, p.dim()).group},"
                f" {place(opt, name, p.dim()).group}): match both names alike"
            )
