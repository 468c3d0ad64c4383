"""What a stage holds on the eager path: the model's modules placed on it, built from the
job's factory under spec.seed (so every parameter equals one process's build) and kept under
the model's own names, computed in the job's precision (with activation checkpointing where
asked); its optimizer and spec.ema's average; each step's gradients, summed over the
micro-batches' distributed autograd contexts in micro-batch order."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
from torch import nn
from torch.utils._pytree import tree_map_only

from pipejob.core.averaged import Ema
from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline.eager import replica_sums
from pipejob.trainer.pipeline.eager.turns import Turns
from pipejob.trainer.pipeline.stage_base import AUTOCAST, Computed, fingerprint
from pipejob.trainer.runtime import checkpoint, ema, state_by_name
from pipejob.trainer.runtime.checkpoint_format import FileEntry, ListedFile
from pipejob.trainer.runtime.optim import Functional, set_lr
from pipejob.trainer.workloads import models
from pipejob.trainer.workloads.batch_values import ForwardKwargs

# How long a call waits for an earlier micro-batch's (turns.py) before the step fails: far
# longer than a micro-batch's forward, far shorter than the watchdog's bound.
TURN_SECONDS = 120.0


def summed_gradients(contexts: list[int]) -> dict[torch.Tensor, torch.Tensor]:
    """Each parameter's gradient in this process summed over the distributed autograd
    `contexts` (one per micro-batch) in their order: the same sum whatever order the
    backwards ended in."""
    summed: dict[torch.Tensor, torch.Tensor] = {}
    for context in contexts:
        for param, grad in dist_autograd.get_gradients(context).items():
            if param in summed:
                summed[param] += grad
            else:
                summed[param] = grad.clone()
    return summed


def squared_norm(grads: dict[torch.Tensor, torch.Tensor]) -> float:
    return float(sum(g.double().square().sum() for g in grads.values()))


class Held:
    """The modules `names` of the job's model, on `device`, with their optimizer; one of
    `replicas` copies of the stage, whose gradients it sums with its own (replica_sums.py)."""

    def __init__(
        self,
        spec: PipelineSpec,
        names: list[str],
        device: str,
        replicas: int = 1,
        train: bool = True,
    ):
        self.device, self.replicas = torch.device(device), replicas
        with torch.random.fork_rng(devices=[]):  # the process's own stream stays as it was
            model = models.build(spec)
        self.modules = nn.ModuleDict(
            {str(k): model.get_submodule(n).to(self.device) for k, n in enumerate(names)}
        )
        self.names = names
        self.by_name = dict(zip(names, self.modules.values(), strict=True))
        # As the traced path's stages compute: in spec.precision, recomputing the forward in
        # the backward with spec.activationCheckpointing.
        autocast, recompute = AUTOCAST[spec.precision], spec.activation_checkpointing
        self.computed = {
            n: Computed(m, self.device, autocast, recompute, last=False)
            for n, m in self.by_name.items()
        }
        # The optimizer's groups match parameters by their names in the whole model.
        mine = {id(p) for m in self.modules.values() for p in m.parameters()}
        named = [(n, p) for n, p in model.named_parameters() if id(p) in mine]
        self.optimizer = Functional(spec.optimizer, named) if train else None
        # What the replicas sum, in the same order in each: the model's order.
        self.trained = [p for _, p in named if p.requires_grad]
        self.params = [p for _, p in named]
        self.average: ema.Average | None = None  # spec.ema's (keep_average)
        self.turns = Turns()
        self.summed: dict[torch.Tensor, torch.Tensor] = {}

    def call(
        self, name: str, turn: tuple[int, int, int], args: tuple[Any, ...], kwargs: ForwardKwargs
    ) -> Any:
        """Module `name` called as the master's glue calls it; `turn` (the micro-batch's
        number, its step's first, which of its calls of `name`) orders it (turns.py)."""
        number, first, nth = turn
        self.turns.wait((name, nth), first, number, TURN_SECONDS)
        try:
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(self.device), (args, kwargs))
            with torch.set_grad_enabled(self.modules.training):  # evaluation: no graph
                out = self.computed[name](*args, **kwargs)
        finally:
            self.turns.made((name, nth), number)
        return tree_map_only(torch.Tensor, lambda t: t.to("cpu"), out)

    def ended(self, number: int) -> None:
        self.turns.ended(number)

    def sum_gradients(self, contexts: list[int], unscale: float = 1.0) -> float:
        """Each parameter's gradient summed over the micro-batches' contexts in their order
        (the same sum on every run), then over the replicas in replica order, times
        `unscale` (1 / fp16's loss scale); its squared L2 norm, for clipping."""
        self.summed = replica_sums.summed(summed_gradients(contexts), self.trained, self.replicas)
        if unscale != 1.0 and self.summed:
            torch._foreach_mul_(list(self.summed.values()), unscale)
        return squared_norm(self.summed)

    def step(self, coefficient: float, lr: float) -> None:
        """Step the optimizer with the summed gradients times the clipping `coefficient`."""
        assert self.optimizer is not None, "this stage holds its modules for evaluation only"
        if coefficient != 1.0:
            for grad in self.summed.values():
                grad.mul_(coefficient)
        set_lr(self.optimizer, lr)
        self.optimizer.step(self.summed)
        self.summed = {}
        if self.average is not None:  # spec.ema: after every applied step
            self.average.update()

    def keep_average(self, settings: Ema) -> None:
        """Keep spec.ema's average of the held parameters from now (runtime/ema.py)."""
        self.average = ema.Average(settings, self.params)

    def swap_average(self) -> None:
        """Exchange the parameters and their average: evaluations and the output of it."""
        assert self.average is not None, "this stage keeps no average (spec.ema)"
        self.average.swap()

    def state(self) -> dict[str, torch.Tensor]:
        """The modules' state under the model's own names, on the CPU."""
        return {
            f"{name}.{key}": value.detach().cpu()
            for name, module in self.by_name.items()
            for key, value in module.state_dict().items()
        }

    def gradient_state(self) -> dict[str, torch.Tensor]:
        """The summed gradients of the step not yet applied, by the model's names (tests)."""
        return {
            f"{name}.{key}": self.summed[p].cpu()
            for name, module in self.by_name.items()
            for key, p in module.named_parameters()
            if p in self.summed
        }

    def fingerprint(self) -> torch.Tensor:
        """Per parameter, its sum and sum of squares: equal in every replica, as they must."""
        return fingerprint(self._named())

    def set_training(self, training: bool) -> None:
        self.modules.train(training)

    def save(self, directory: str, name: str) -> FileEntry:
        """Checkpoint the modules and the optimizer's state (under the model's names)."""
        return checkpoint.save_module(directory, name, self._named(), self.kept())

    def load(self, directory: str, entries: list[ListedFile]) -> None:
        """The modules and what `kept` holds by the model's names from the checkpoint files
        `entries` (written by any path and any cut: runtime/state_by_name.py load_named)."""
        state_by_name.load_named(directory, entries, self._named(), self.kept())

    def kept(self) -> dict[str, checkpoint.OptimizerLike]:
        """What a checkpoint keeps beside the weights, by key: the optimizer's state and
        spec.ema's average (shaped as an optimizer's)."""
        assert self.optimizer is not None
        kept: dict[str, checkpoint.OptimizerLike] = {"optimizer": self.optimizer}
        if self.average is not None:
            kept[ema.CHECKPOINT_KEY] = self.average
        return kept

    def state_names(self) -> list[str]:
        return list(self._named().state_dict())

    def _named(self) -> nn.Module:
        return _Named(self.by_name)


class _Named(nn.Module):
    """The held modules under the model's own names (dotted names as nested modules)."""

    def __init__(self, by_name: dict[str, nn.Module]):
        super().__init__()
        for name, module in by_name.items():
            parent: nn.Module = self
            *path, last = name.split(".")
            for part in path:
                if part not in parent._modules:
                    parent._modules[part] = nn.Module()
                parent = parent._modules[part]  # type: ignore[assignment]
            parent._modules[last] = module
