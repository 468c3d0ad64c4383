"""MONAI's models as its tutorials build them (issue 56): UNet trained on MetaTensors from an
ArrayDataset with DiceLoss, DynUNet with deep supervision under DeepSupervisionLoss; small,
on seeded one-channel images whose masks are their bright pixels."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from monai.data import ArrayDataset
from monai.losses import DeepSupervisionLoss, DiceLoss
from monai.networks.nets import DynUNet, UNet
from monai.transforms import Compose, EnsureType, ScaleIntensity
from torch import nn


def segmentation(split: str, count: int = 32, size: int = 16) -> ArrayDataset:
    """ArrayDataset over arrays, its transforms making MetaTensors of images and masks."""
    rng = np.random.default_rng(0 if split == "train" else 1)
    images = [rng.random((1, size, size), dtype=np.float32) for _ in range(count)]
    masks = [(image > 0.5).astype(np.float32) for image in images]
    return ArrayDataset(
        images, Compose([ScaleIntensity(), EnsureType()]), masks, Compose([EnsureType()])
    )


def unet() -> nn.Module:
    return UNet(
        spatial_dims=2,
        in_channels=1,
        out_channels=1,
        channels=(4, 8, 16),
        strides=(2, 2),
        num_res_units=1,
    )


def dice_loss() -> DiceLoss:
    return DiceLoss(sigmoid=True)


def dynunet() -> nn.Module:
    """DynUNet with deep supervision: in training its output stacks the heads on dim 1."""
    return DynUNet(
        spatial_dims=2,
        in_channels=1,
        out_channels=1,
        kernel_size=[3, 3, 3],
        strides=[1, 2, 2],
        upsample_kernel_size=[2, 2],
        filters=[4, 8, 16],
        deep_supervision=True,
        deep_supr_num=1,
    )


def deep_supervision_loss() -> Any:
    """The tutorial's: DeepSupervisionLoss over the heads unbound from the stacked output
    (in evaluation DynUNet gives the main head alone)."""
    supervised = DeepSupervisionLoss(DiceLoss(sigmoid=True))

    def loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        heads = torch.unbind(outputs, dim=1) if outputs.dim() == labels.dim() + 1 else outputs
        return supervised(heads, labels)

    return loss
