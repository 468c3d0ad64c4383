"""pipejob's own decoder-only transformer language model, in plain torch.nn: token and
position embeddings, pre-norm blocks of causal self-attention and an MLP, a final norm and
a head onto the vocabulary. Its blocks are a ModuleList, so a pipeline can begin a stage at
any block (candidates: embed, blocks.0 .. blocks.{n-1}, norm, head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipejob.core.workload import Transformer


class Embed(nn.Module):
    """Token embeddings plus learned position embeddings."""

    def __init__(self, vocab_size: int, width: int, seq_len: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(seq_len, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        where = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(where)


class Block(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        # (batch, heads, length, head width) for the fused attention kernel
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    def __init__(self, spec: Transformer):
        super().__init__()
        if spec.width % spec.heads:
            raise ValueError(
                f"transformer width {spec.width} is not divisible by heads {spec.heads}"
            )
        self.embed = Embed(spec.vocab_size, spec.width, spec.seq_len)
        self.blocks = nn.ModuleList(Block(spec.width, spec.heads) for _ in range(spec.layers))
        self.norm = nn.LayerNorm(spec.width)
        self.head = nn.Linear(spec.width, spec.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, length) -> next-token logits (batch, length, vocab)."""
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
