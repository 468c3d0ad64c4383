"""A small protein encoder written as fair-esm writes ESM-2 (float64, for exactness checks):
layers that take keyword arguments and return tuples holding None, and glue no trace can
read (`if not padding_mask.any(): padding_mask = None`, a Python list of representations
filled as the layers run). Its tokens: padded sequences in some batches, none in others."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

PADDING, VOCAB = 1, 33


class TransformerLayer(nn.Module):
    """ESM's pre-norm layer: `(x, attn)`, attn None unless need_head_weights."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x, self_attn_padding_mask=None, need_head_weights=False):
        residual = x
        x = self.self_attn_layer_norm(x)
        x, attn = self.self_attn(
            x, x, x, key_padding_mask=self_attn_padding_mask, need_weights=need_head_weights
        )
        x = residual + x
        residual = x
        x = self.fc2(torch.nn.functional.gelu(self.fc1(self.final_layer_norm(x))))
        return residual + x, attn


class ESM2(nn.Module):
    def __init__(self, num_layers: int = 4, embed_dim: int = 32, heads: int = 4, classes: int = 5):
        super().__init__()
        self.padding_idx = PADDING
        self.embed_scale = 1.0
        self.embed_tokens = nn.Embedding(VOCAB, embed_dim, padding_idx=PADDING)
        self.layers = nn.ModuleList(TransformerLayer(embed_dim, heads) for _ in range(num_layers))
        self.emb_layer_norm_after = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, classes)

    def forward(self, tokens, repr_layers=(), need_head_weights=False):
        padding_mask = tokens.eq(self.padding_idx)
        x = self.embed_scale * self.embed_tokens(tokens)
        x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
        if not padding_mask.any():
            padding_mask = None
        hidden = [x]
        for layer in self.layers:
            x, attn = layer(
                x, self_attn_padding_mask=padding_mask, need_head_weights=need_head_weights
            )
            assert attn is None or need_head_weights
            hidden.append(x)
        x = self.emb_layer_norm_after(hidden[-1])
        if padding_mask is not None:
            keep = (~padding_mask).unsqueeze(-1).type_as(x)
            pooled = (x * keep).sum(1) / keep.sum(1)
        else:
            pooled = x.mean(1)
        return {"logits": self.head(pooled), "representations": {}}


def esm2(**args) -> nn.Module:
    return ESM2(**args).double()


class Sequences(Dataset):
    """Seeded token sequences of `length`: every odd sample padded at its end, so a
    micro-batch of one sample has padding or not."""

    def __init__(self, size: int, length: int, classes: int, seed: int):
        self.size, self.length, self.classes, self.seed = size, length, classes, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        tokens = torch.randint(4, VOCAB, (self.length,), generator=g)
        if i % 2:
            tokens[-self.length // 3 :] = PADDING
        return tokens, int(torch.randint(self.classes, (), generator=g))


def sequences(split: str, size: int = 64, length: int = 12, classes: int = 5) -> Sequences:
    return Sequences(size, length, classes, seed=0 if split == "train" else 1)
