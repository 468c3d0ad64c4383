"""pytorch-tabnet's TabNet network as TabNetClassifier builds it, returning `(logits,
M_loss)`, trained with the classifier's own loss (issue 56, class 3), on seeded rows."""

from __future__ import annotations

from typing import Any

import torch
from pytorch_tabnet.tab_network import TabNet
from pytorch_tabnet.utils import create_group_matrix
from torch import nn


def tabnet(features: int = 8, classes: int = 3) -> nn.Module:
    return TabNet(
        features,
        classes,
        n_d=8,
        n_a=8,
        n_steps=3,
        virtual_batch_size=4,
        group_attention_matrix=create_group_matrix([], features),  # as TabModel makes it
    )


class Table(torch.utils.data.Dataset):
    """Seeded rows of `features` numbers, the class the argmax of their first `classes`."""

    def __init__(self, split: str, count: int, features: int, classes: int):
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.x = torch.randn(count, features, generator=g)
        self.y = self.x[:, :classes].argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def table(split: str, count: int = 32, features: int = 8, classes: int = 3) -> Table:
    return Table(split, count, features, classes)


def tabnet_loss(lambda_sparse: float = 1e-3) -> Any:
    """TabNetClassifier's training loss: cross-entropy less lambda_sparse x M_loss."""

    def loss(outputs: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        logits, m_loss = outputs
        return nn.functional.cross_entropy(logits, labels) - lambda_sparse * m_loss

    return loss
