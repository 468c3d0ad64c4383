"""A stage's module (workloads/cut.py makes them): the model's forward from where the stage
begins to where the next begins, as fx's generated code run on the model's own modules,
holding the state that code uses under the model's names."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import fx, nn

from pipejob.trainer.workloads.model_guards import cache_configs, without_cache
from pipejob.trainer.workloads.tracing import running_on

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
            self.__dict__.pop("configs", None)
        if "configs" not in self.__dict__:
            self.__dict__["configs"] = cache_configs(self)
        # The modules it calls whole run as the model was traced: with no key/value cache.
        with without_cache(self, self.__dict__["configs"]), running_on(lambda: self._device(args)):
            return piece(*args)

    def _device(self, args: tuple[Any, ...]) -> torch.device:
        """Where the stage runs: its parameters', buffers' or inputs' device."""
        for value in itertools.chain(self.parameters(), self.buffers(), args):
            if isinstance(value, torch.Tensor):
                return value.device
        return torch.device("cpu")

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


def attach(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """`param` held by `module` under the dotted `name`, making plain modules on the way."""
    *path, attr = name.split(".")
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    module.register_parameter(attr, param)
