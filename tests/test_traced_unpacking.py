"""Unpacking on the traced path (issue 56, class 9): a traced shape unpacked with a star
(`b, c, h, w, device = *img.shape, img.device`) and a submodule's tuple output unpacked
(`x, *rest = quantizer(x)`) are cut as the user guide says: sizes read from the input are
concrete while tracing with the job's shapes, and the batch size follows each batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from userpkg.traced_cases import UnpacksOutput, UnpacksShape

from pipejob.trainer.workloads.cut import Traced

pytestmark = pytest.mark.timeout(60)


def run(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    value = x
    for stage in stages:
        value = stage(*value) if isinstance(value, tuple) else stage(value)
    return value


@pytest.mark.parametrize(
    "model,sample",
    [(UnpacksShape, (2, 3, 5, 5)), (UnpacksOutput, (2, 8))],
    ids=["star-unpacked-shape", "star-unpacked-output"],
)
def test_unpacking_is_cut_exactly_at_any_batch_size(model, sample):
    torch.manual_seed(0)
    module, x = model(), torch.randn(*sample)
    traced = Traced(module, 3, sample=x)  # with the job's shapes, as the stages trace
    assert not traced.whole, traced.whole
    stages = traced.split([traced.units[1]])
    for batch in (x, torch.randn(3, *sample[1:])):  # another batch size: b follows it
        torch.testing.assert_close(run(stages, batch), module(batch), rtol=0, atol=0)
