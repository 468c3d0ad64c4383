"""fair-esm's ESM2 class in a small config (the ESM-1b alphabet, 2 layers), trained as a
masked language model on sequences its batch converter makes: the glue reads
`padding_mask.any()` (issue 56, class 6)."""

from __future__ import annotations

import esm
import numpy as np
import torch
from esm.model.esm2 import ESM2
from torch import nn


def esm2() -> nn.Module:
    return ESM2(num_layers=2, embed_dim=32, attention_heads=4, alphabet="ESM-1b")


class MaskedProteins(torch.utils.data.Dataset):
    """Seeded protein sequences through ESM's batch converter, 15% of residues masked: the
    input the masked tokens, the labels the residues there and -100 elsewhere."""

    def __init__(self, split: str, count: int, length: int):
        alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
        rng = np.random.default_rng(0 if split == "train" else 1)
        letters = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
        sizes = [length - 2 - (i % 2) * 3 for i in range(count)]  # every other one padded
        pairs = [(str(i), "".join(rng.choice(letters, n))) for i, n in enumerate(sizes)]
        _, _, tokens = alphabet.get_batch_converter()(pairs)
        residue = (tokens != alphabet.padding_idx) & (tokens != alphabet.cls_idx)
        residue &= tokens != alphabet.eos_idx
        masked = residue & torch.from_numpy(rng.random(tokens.shape) < 0.15)
        self.labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
        self.tokens = torch.where(masked, torch.full_like(tokens, alphabet.mask_idx), tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i], self.labels[i]


def proteins(split: str, count: int = 32, length: int = 16) -> MaskedProteins:
    return MaskedProteins(split, count, length)
