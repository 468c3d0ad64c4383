"""Generated stage code and the module it came from (issue 56, class 2): a forward that
calls a function its module imported (`from torch.nn.functional import interpolate`, as
MONAI's DynUNet does) is cut exactly; and the DynUNet failure behind its `KeyError:
interpolate` (its skip layers write deep-supervision heads into a Python list that its
forward reads) leaves no traced value in the model, is cut exactly where the trace follows
the write, and is refused, saying why, where the trace would fix the value read."""

from __future__ import annotations

import pytest
import torch
from userpkg.traced_cases import DeepSupervision

from pipejob.trainer.workloads.cut import CutError, Traced

pytestmark = pytest.mark.timeout(60)


def run(stages, x):
    value = x
    for stage in stages:
        value = stage(*value) if isinstance(value, tuple) else stage(value)
    return value


def test_heads_written_and_read_in_one_trace_are_cut_exactly_and_the_model_kept():
    torch.manual_seed(0)
    model, x = DeepSupervision(), torch.randn(2, 2, 8, 8)
    traced = Traced(model, 8, sample=x)  # the skip layers opened: the write is traced
    assert all(isinstance(h, torch.Tensor) for h in model.heads)  # no traced value left
    stages = traced.split(["output_block"])  # `interpolate`, the module's name, resolves
    torch.testing.assert_close(run(stages, x), model(x), rtol=0, atol=0)


def test_heads_a_trace_would_fix_are_refused_saying_why():
    """The skip layers kept whole, the forward's read of their heads would be a constant
    (before: a traced value an earlier trace left there, `KeyError: interpolate`). As built
    (MONAI's `[torch.rand(1)]`) the read fails at its line; after a forward ran, it is
    refused for what it is."""
    model = DeepSupervision()
    Traced(model, 8)  # an earlier trace (fx's plain one, or another mode's) ran the writes
    with pytest.raises(CutError, match=r"at traced_cases.py:\d+: return torch.stack\(\[out, inter"):
        Traced(model, 2, required=["output_block"])
    model(torch.randn(2, 2, 8, 8))  # the heads as a forward leaves them
    with pytest.raises(CutError, match=r"its forward reads heads\[0\] of the model, a tensor"):
        Traced(model, 2, required=["output_block"])
    assert all(isinstance(h, torch.Tensor) for h in model.heads)


class Anchors(torch.nn.Module):
    """torchvision's AnchorGenerator's habit: constant tensors in a Python list, read only."""

    def __init__(self):
        super().__init__()
        self.cell_anchors = [torch.arange(4.0)]
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x) + self.cell_anchors[0])


def test_a_list_of_constants_the_forward_only_reads_is_cut():
    model, x = Anchors(), torch.randn(2, 4)
    stages = Traced(model, 2).split(["b"])
    torch.testing.assert_close(run(stages, x), model(x), rtol=0, atol=0)
