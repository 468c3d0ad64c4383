"""A ResNet-18 and its images in float64, for tests whose check is about the algorithm and
not float32's rounding: two computations that add the same terms in another order (an
all-reduce against one backward, other kernels, other thread counts) agree in float64 to
about 1e-12 of the magnitudes involved on any machine, where float32 may differ by 1e-4
after BatchNorm's backward amplifies it."""

from __future__ import annotations

import torch
import torchvision
from torch import nn
from torch.utils.data import Dataset


def resnet18(classes: int = 10) -> nn.Module:
    return torchvision.models.resnet18(num_classes=classes).double()


class Images(Dataset):
    """Seeded random images: sample i is a function of (seed, i) alone."""

    def __init__(self, size: int, image_size: int, classes: int, seed: int):
        self.size, self.image_size, self.classes, self.seed = size, image_size, classes, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        image = torch.randn(3, self.image_size, self.image_size, generator=g, dtype=torch.float64)
        return image, int(torch.randint(self.classes, (), generator=g))


def images(split: str, size: int = 256, image_size: int = 64, classes: int = 10) -> Images:
    return Images(size, image_size, classes, seed=0 if split == "train" else 1)
