"""The validation's torch-free facts about each PipelineJob model (core/kinds/model_facts.py)
measured with the trainer's own cutter, on the meta device (no memory, no arithmetic)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.models import get_model

from harness.variants import exhaustive
from pipejob.core.kinds.model_facts import BATCHNORM, LAYERS, MIN_IMAGE_SIZE
from pipejob.core.kinds.pipeline import PIPELINE_MODELS
from pipejob.trainer.workloads.cut import Traced

pytestmark = pytest.mark.timeout(120)

SMALLEST = 32  # spec.imageSize's minimum


def forward_works(model: nn.Module, size: int) -> bool:
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, size, size, device="meta"))
        return True
    except RuntimeError:
        return False


# One of each family in `make test` (ResNet, VGG, EfficientNet, ConvNeXt), every model in
# `make test-all`: the big ones take half a minute each to trace, even on the meta device.
@pytest.mark.parametrize(
    "name",
    exhaustive(
        PIPELINE_MODELS,
        {
            "resnet18",
            "resnet50",
            "vgg11",
            "efficientnet_b0",
            "convnext_tiny",
        },
    ),
)
def test_the_table_knows_the_model_as_the_trainer_cuts_it(name):
    with torch.device("meta"):
        model = get_model(name, weights=None, num_classes=10).eval()
    assert LAYERS[name] == len(Traced(model).units)
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert (name in BATCHNORM) == has_batchnorm
    least = MIN_IMAGE_SIZE.get(name, SMALLEST)
    assert forward_works(model, least)
    if least > SMALLEST:
        assert not forward_works(model, least - 1)
