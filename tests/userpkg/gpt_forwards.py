"""A small GPT of our own with the three forwards popular GPT repositories ship (issue 56,
class 3), for tests that must not depend on a clone of them (tests/test_shipped_gpts.py runs
the real files from the user's own clones):

- nanoGPT's and llm.c's: `forward(idx, targets=None) -> (logits, loss)`; without targets,
  the last position's logits only and None;
- minGPT's: the same, with every position's logits and None.

Each builder is a user's factory: `userpkg.gpt_forwards:nanogpt`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP, each added to the residual stream."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, blocks, a final norm and a head tied to the tokens'
    embedding; `last_only`: without targets, only the last position's logits (nanoGPT's
    inference shortcut)."""

    def __init__(self, vocab: int, length: int, layers: int, heads: int, width: int, last_only):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.last_only = last_only

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            flat = logits.view(-1, logits.size(-1))
            return logits, F.cross_entropy(flat, targets.view(-1), ignore_index=-1)
        return self.lm_head(x[:, [-1], :] if self.last_only else x), None


def nanogpt(vocab: int = 64, length: int = 16, layers: int = 2, heads: int = 2, width: int = 32):
    return GPT(vocab, length, layers, heads, width, last_only=True)


def llmc(vocab: int = 64, length: int = 16, layers: int = 2, heads: int = 2, width: int = 32):
    return GPT(vocab, length, layers, heads, width, last_only=True)


def mingpt(vocab: int = 64, length: int = 16, layers: int = 2, heads: int = 2, width: int = 32):
    return GPT(vocab, length, layers, heads, width, last_only=False)
