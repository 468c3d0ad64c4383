"""Models no tracer reads, staged by their user (spec.model.staged): a GRU over packed
sequences (its forward packs the padded batch by the lengths it reads from the tokens), with a
function building stage i of n from its own modules (torchtitan's way); the seeds' ResNet-50
split into two shards by hand (tiny here), as layers of a model or as a stage function's
stages; padded token sequences to classify."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import Dataset
from torchvision.models.resnet import Bottleneck

VOCAB, SEQ, CLASSES = 32, 12, 3


class PackedGRU(nn.Module):
    """Token embedding, a GRU over the packed (unpadded) sequences, a linear head on the last
    hidden state: as users write it (no tracer reads pack_padded_sequence's glue)."""

    def __init__(self, width: int = 16, classes: int = CLASSES):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width, padding_idx=0)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, classes)

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        lengths = (tokens != 0).sum(1).clamp(min=1).cpu()
        packed = pack_padded_sequence(
            self.embed(tokens), lengths, batch_first=True, enforce_sorted=False
        )
        _, hidden = self.gru(packed)
        return hidden[-1]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encode(tokens))


class Encoder(nn.Module):
    """Stage 0 of the GRU: its embedding and GRU, under the model's names."""

    def __init__(self, model: PackedGRU):
        super().__init__()
        self.embed, self.gru = model.embed, model.gru

    forward = PackedGRU.encode


class Head(nn.Module):
    def __init__(self, model: PackedGRU):
        super().__init__()
        self.head = model.head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def gru_stage(stage: int, stages: int, width: int = 16) -> nn.Module:
    """Stage `stage` of 2: the whole model built, its stage's modules kept."""
    assert stages == 2, "the GRU is staged in 2"
    model = PackedGRU(width)
    return Encoder(model) if stage == 0 else Head(model)


class Padded(Dataset):
    """Token sequences of random lengths padded with 0, labelled by their first token."""

    def __init__(self, split: str = "train", size: int = 64):
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.tokens = torch.randint(1, VOCAB, (size, SEQ), generator=g)
        lengths = torch.randint(1, SEQ + 1, (size,), generator=g)
        self.tokens[torch.arange(SEQ) >= lengths[:, None]] = 0
        self.labels = self.tokens[:, 0] % CLASSES

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i], self.labels[i]


def padded(split: str, size: int = 64) -> Dataset:
    return Padded(split, size)


# --- the seeds' ResNet-50 shards (pipeline tutorial), their forward taking a tensor ---------


class ResNetBase(nn.Module):
    def __init__(self, inplanes: int, width: int):
        super().__init__()
        self.inplanes, self.width = inplanes, width

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        planes = planes * self.width // 64
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)


class ResNetShard1(ResNetBase):
    """The tutorial's first shard: the stem, layer1 and layer2 (width 64: ResNet-50's)."""

    def __init__(self, width: int = 64, blocks: tuple[int, ...] = (3, 4, 6, 3)):
        super().__init__(width, width)
        self.seq = nn.Sequential(
            nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(self.inplanes),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            self._make_layer(64, blocks[0]),
            self._make_layer(128, blocks[1], stride=2),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x)


class ResNetShard2(ResNetBase):
    """The second shard: layer3, layer4, pooling and the classifier."""

    def __init__(
        self, width: int = 64, blocks: tuple[int, ...] = (3, 4, 6, 3), num_classes: int = 10
    ):
        super().__init__(8 * width, width)
        self.seq = nn.Sequential(
            self._make_layer(256, blocks[2], stride=2),
            self._make_layer(512, blocks[3], stride=2),
            nn.AdaptiveAvgPool2d((1, 1)),
        )
        self.fc = nn.Linear(self.inplanes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.seq(x), 1))


def resnet_shard(
    stage: int,
    stages: int,
    width: int = 64,
    blocks: tuple[int, ...] = (3, 4, 6, 3),
    num_classes: int = 10,
) -> nn.Module:
    """The seeds' shard `stage` of 2 (torchtitan's way: each process builds its own)."""
    assert stages == 2, "the tutorial's ResNet-50 has 2 shards"
    blocks = tuple(blocks)
    if stage == 0:
        return ResNetShard1(width, blocks)
    return ResNetShard2(width, blocks, num_classes)


class ResNetShards(nn.Module):
    """Both shards in one model (layers: [shard1, shard2])."""

    def __init__(
        self, width: int = 64, blocks: tuple[int, ...] = (3, 4, 6, 3), num_classes: int = 10
    ):
        super().__init__()
        self.shard1 = ResNetShard1(width, tuple(blocks))
        self.shard2 = ResNetShard2(width, tuple(blocks), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shard2(self.shard1(x))


class Mean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


class Layered(nn.Module):
    """Token embedding, blocks, mean over positions, head: staged as layers (no forward of
    its own is used); `forward` is the same chain, for one process."""

    def __init__(self, width: int = 16, blocks: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)
        )
        self.pool = Mean()
        self.head = nn.Linear(width, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.pool(x))
