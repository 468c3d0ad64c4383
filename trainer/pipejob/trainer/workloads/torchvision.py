"""A torchvision classification model by name, cut into an ordered list of named layers.

Running the layers one after another computes exactly what the model's own forward does;
a pipeline stage then holds any contiguous run of them. Layers are as fine as the model's
structure allows cheaply (residual blocks, conv blocks, classifier pieces), so the
partitioner has room to balance."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn
from torchvision.models import ResNet, get_model

Layer = tuple[str, nn.Module]


def build_model(name: str, num_classes: int) -> nn.Module:
    """The torchvision model, randomly initialised from torch's current seed."""
    return get_model(name, weights=None, num_classes=num_classes)


def cut(model: nn.Module) -> list[Layer]:
    """The model as (name, module) layers whose sequential composition equals its forward."""
    if isinstance(model, ResNet):
        stem = [(n, getattr(model, n)) for n in ("conv1", "bn1", "relu", "maxpool")]
        blocks = [
            (f"{stage}.{i}", block)
            for stage in ("layer1", "layer2", "layer3", "layer4")
            for i, block in enumerate(getattr(model, stage))
        ]
        head = [("avgpool", model.avgpool), ("flatten", nn.Flatten(1)), ("fc", model.fc)]
        return stem + blocks + head
    features = getattr(model, "features", None)
    classifier = getattr(model, "classifier", None)
    if not isinstance(features, nn.Sequential) or not isinstance(classifier, nn.Sequential):
        raise ValueError(
            f"cannot cut {type(model).__name__} into pipeline layers: expected a ResNet or a"
            " model with `features` and `classifier` sequences"
        )
    # MobileNetV2 pools functionally in its forward; everyone else has an avgpool module.
    pool = getattr(model, "avgpool", None)
    if pool is None:
        pool = nn.AdaptiveAvgPool2d(1)
    layers = _feature_layers(features) + [("avgpool", pool)]
    # ConvNeXt flattens inside its classifier; the others flatten in their forward.
    if not any(isinstance(m, nn.Flatten) for m in classifier):
        layers.append(("flatten", nn.Flatten(1)))
    return layers + _grouped("classifier", list(classifier), nn.Linear)


def _feature_layers(features: nn.Sequential) -> list[Layer]:
    children = list(features)
    # A flat conv stack (VGG, AlexNet): one layer per conv with its norm/activation/pool.
    if any(isinstance(m, nn.Conv2d) for m in children):
        return _grouped("features", children, nn.Conv2d)
    # A stack of blocks (MobileNet, EfficientNet, ConvNeXt); plain Sequentials of blocks are
    # opened one level so each residual block can be a layer of its own.
    layers: list[Layer] = []
    for i, child in enumerate(children):
        if type(child) is nn.Sequential and not any(isinstance(m, nn.Conv2d) for m in child):
            layers += [(f"features.{i}.{j}", block) for j, block in enumerate(child)]
        else:
            layers.append((f"features.{i}", child))
    return layers


def _grouped(prefix: str, modules: list[nn.Module], starts: type[nn.Module]) -> list[Layer]:
    """Group a flat list into layers that each hold one `starts` module (Conv2d, Linear) with
    the modules after it (norm, activation, pool, dropout); any before the first join it."""
    groups: list[list[int]] = [[]]
    for i, module in enumerate(modules):
        if isinstance(module, starts) and any(isinstance(modules[j], starts) for j in groups[-1]):
            groups.append([])
        groups[-1].append(i)
    layers: list[Layer] = []
    for group in groups:
        if len(group) == 1:
            layers.append((f"{prefix}.{group[0]}", modules[group[0]]))
        else:
            block = nn.Sequential(*(modules[i] for i in group))
            layers.append((f"{prefix}.{group[0]}-{group[-1]}", block))
    return layers


def sequential(layers: list[Layer]) -> nn.Sequential:
    """The layers as one module; parameter names keep the layer names ('layer1_0.conv1.weight'),
    so a shard's parameters can be matched with the whole model's."""
    return nn.Sequential(OrderedDict((name.replace(".", "_"), module) for name, module in layers))
