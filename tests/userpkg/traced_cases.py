"""Models and factories for issue 56's failure classes on the traced path
(tests/test_traced_*.py): each as a user's or a library's code writes it."""

from __future__ import annotations

import torch
from torch import nn


def failing_factory(width: int = 4) -> nn.Module:
    """A factory that raises on its own line (a user's typo, a missing file)."""
    sizes = {"small": width}
    return nn.Linear(sizes["large"], width)  # the user's line: KeyError 'large'


class DictInputs(nn.Module):
    """An audio seq2seq model's habit: one dict of named inputs, {features, tokens}."""

    def __init__(self, width: int = 8, vocab: int = 11, classes: int = 3):
        super().__init__()
        self.encode = nn.Linear(width, width)
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, batch: dict) -> torch.Tensor:
        h = self.encode(batch["features"]) + self.embed(batch["tokens"]).mean(1)
        return self.head(torch.relu(self.mix(h)))


def dict_label_loss(outputs: torch.Tensor, labels: dict) -> torch.Tensor:
    """A loss of a label dict, {cls}."""
    return nn.functional.cross_entropy(outputs, labels["cls"])


def dict_labels() -> object:
    """spec.loss.import's factory of `dict_label_loss`."""
    return dict_label_loss


class DictData(torch.utils.data.Dataset):
    """Samples of named inputs and a named label: ({features, tokens}, {cls})."""

    def __init__(self, size: int, width: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.features = torch.randn(size, width, generator=g)
        self.tokens = torch.randint(0, 11, (size, 5), generator=g)
        self.cls = (self.features[:, 0] > 0).long() + (self.tokens[:, 0] > 5).long()

    def __len__(self) -> int:
        return len(self.cls)

    def __getitem__(self, i: int) -> tuple[dict, dict]:
        return {"features": self.features[i], "tokens": self.tokens[i]}, {"cls": self.cls[i]}


def dict_data(split: str, size: int = 256) -> DictData:
    return DictData(size if split == "train" else size // 4, seed=0 if split == "train" else 1)


def dict_inputs() -> nn.Module:
    return DictInputs()


def gpt_loss() -> object:
    """spec.loss.import for a `(logits, loss)` GPT called without targets: cross-entropy of
    the positions it gives logits for (nanoGPT and llm.c: the last; minGPT: every one)."""

    def loss(outputs: tuple, labels: torch.Tensor) -> torch.Tensor:
        logits, _ = outputs
        labels = labels[:, -logits.size(1) :]
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return loss


def frozen_tied_lm(width: int = 32) -> nn.Module:
    """LoRA's habit over a tied embedding: the embedding, which the output layer reuses, is
    frozen; the blocks train (userpkg.tied's model)."""
    from userpkg.tied import TiedLM

    model = TiedLM(width)
    model.embed.weight.requires_grad_(False)
    return model
