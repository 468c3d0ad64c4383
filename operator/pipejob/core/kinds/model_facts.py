"""What the validation must know of each PipelineJob model without importing torch (how many
places the trainer may cut it at, the smallest image it takes, whether it has BatchNorm) and
`model_errors`, the checks built on them. tests/test_models.py measures every entry with the
trainer's own cutter."""

from __future__ import annotations

from pipejob.core.errors import SpecError
from pipejob.core.kind import RawSpec

# Units of trainer/pipejob/trainer/workloads/cut.py's cut (the places a stage may begin):
# at most one stage each.
LAYERS: dict[str, int] = {
    "resnet18": 14,
    "resnet34": 22,
    "resnet50": 22,
    "resnet101": 39,
    "resnet152": 56,
    "resnext50_32x4d": 22,
    "resnext101_32x8d": 39,
    "wide_resnet50_2": 22,
    "wide_resnet101_2": 39,
    "vgg11": 29,
    "vgg13": 33,
    "vgg16": 39,
    "vgg19": 45,
    "vgg11_bn": 37,
    "vgg13_bn": 43,
    "vgg16_bn": 52,
    "vgg19_bn": 61,
    "alexnet": 21,
    "mobilenet_v2": 21,
    "mobilenet_v3_small": 18,
    "mobilenet_v3_large": 22,
    "efficientnet_b0": 21,
    "efficientnet_b1": 28,
    "convnext_tiny": 29,
}

# Smallest square image (px) the model's forward accepts; 32, the spec's minimum, otherwise.
MIN_IMAGE_SIZE: dict[str, int] = {"alexnet": 63}

# Models with BatchNorm layers: a micro-batch of one image fails in training mode.
BATCHNORM: frozenset[str] = frozenset(
    {
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
        "resnext50_32x4d",
        "resnext101_32x8d",
        "wide_resnet50_2",
        "wide_resnet101_2",
        "vgg11_bn",
        "vgg13_bn",
        "vgg16_bn",
        "vgg19_bn",
        "mobilenet_v2",
        "mobilenet_v3_small",
        "mobilenet_v3_large",
        "efficientnet_b0",
        "efficientnet_b1",
    }
)


def model_errors(spec: RawSpec) -> list[SpecError]:
    """What would make a valid-looking pipeline crash once its world has started."""
    errors = []
    model, stages = spec["model"].get("torchvision"), spec["stages"] * spec["stagesPerProcess"]
    layers = LAYERS.get(model)
    transformer = spec["model"].get("transformer")
    if transformer is not None:  # embed, each block, norm, head
        model, layers = "the transformer", transformer["layers"] + 3
    if layers is not None and stages > layers:
        asked = (
            f"{spec['stages']} x stagesPerProcess {spec['stagesPerProcess']}"
            if spec["stagesPerProcess"] > 1
            else str(stages)
        )
        why = f"{model} has {layers} places to cut; it can fill at most {layers} stages"
        errors.append(SpecError("spec.stages", f"{why}, not {asked}"))
    least = MIN_IMAGE_SIZE.get(model, 0)
    if spec["imageSize"] < least:
        why = f"{model} needs images of at least {least} px, got {spec['imageSize']}"
        errors.append(SpecError("spec.imageSize", why))
    micro = spec["microBatches"]
    if model in BATCHNORM:
        if micro != "auto" and spec["batchSize"] == micro:
            why = (
                f"{model} has BatchNorm, which cannot train on micro-batches of one image"
                f" (batchSize {spec['batchSize']} / microBatches {micro})"
            )
            errors.append(SpecError("spec.microBatches", why))
        elif spec["batchSize"] == 1:
            why = f"{model} has BatchNorm, which cannot train on batches of one image"
            errors.append(SpecError("spec.batchSize", why))
    return errors
