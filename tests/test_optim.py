"""A pipeline stage's optimizer (runtime/optim.py's Functional): torch.optim's arithmetic and
state through torch's functional forms, without building a torch.optim optimizer (which
imports torch._dynamo into every stage process)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pipejob.core.common_spec import Optimizer, from_spec
from pipejob.trainer.runtime.optim import Functional, optimizer_args, set_lr


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "rmsprop"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_each_optimizer_steps_as_torch_optim_does(name: str, momentum: float) -> None:
    opt = from_spec(
        Optimizer, {"name": name, "lr": 0.05, "momentum": momentum, "weightDecay": 0.01}
    )
    torch.manual_seed(0)
    ours = [torch.randn(5, 3, dtype=torch.float64, requires_grad=True), torch.randn(4)]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    cls, kwargs = optimizer_args(opt)
    reference = cls(theirs, **kwargs)
    functional = Functional(opt, [(str(i), p) for i, p in enumerate(ours)])
    for step in range(4):
        grads = [torch.randn_like(p) for p in ours]
        if step == 2:  # a parameter without a gradient is left as it is, state and all
            grads[1] = None
        for p, g in zip(theirs, grads, strict=True):
            p.grad = g
        reference.step()
        functional.step({p: g for p, g in zip(ours, grads, strict=True) if g is not None})
        for lr in (0.02,) if step == 1 else ():  # a schedule's learning rate
            set_lr(reference, lr)
            set_lr(functional, lr)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        assert functional.state[a].keys() == reference.state[b].keys()
        for key, value in reference.state[b].items():
            assert torch.equal(functional.state[a][key], value), key


def test_a_stage_process_steps_without_importing_dynamo_or_distributed_optim() -> None:
    code = """
import sys, torch
from pipejob.core.common_spec import Optimizer, from_spec
from pipejob.trainer.pipeline.rpc import stage
from pipejob.trainer.runtime.optim import Functional
p = torch.nn.Parameter(torch.ones(3))
o = Functional(from_spec(Optimizer, {"name": "adam", "lr": 0.1, "momentum": 0.0,
                                     "weightDecay": 0.0}), [("p", p)])
p.grad = torch.ones(3)
o.step()
print(sorted(m for m in ("torch._dynamo", "torch.distributed.optim", "sympy") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
