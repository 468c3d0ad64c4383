"""A HybridJob's model, as one process would hold it: the tables' initial rows, the built-in
DLRM (the dense part), the call of a dense part on pooled embeddings, `Recommender` (the
tables and the dense part in one nn.Module: the single-process reference of the tests, and
the layout of the trained model's file), and the figures of a click model (AUC, log loss).

Initial rows are seeded per block of BLOCK rows by (seed, table, block): a parameter server
makes its rows of a table alone, and they equal the same rows of the whole table made in one
process, wherever the table is split."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pipejob.core.kinds.tables import Table

BLOCK = 1 << 16  # rows drawn from one seed


def _block_seed(seed: int, table: str, block: int) -> int:
    digest = hashlib.sha256(f"pipejob-table:{seed}:{table}:{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch seeds are below 2**63


def initial_rows(table: Table, seed: int, start: int, stop: int) -> torch.Tensor:
    """Rows start..stop-1 of `table` at initialization: uniform in +-1/sqrt(rows), as
    TorchRec's and DLRM's tables start."""
    bound = 1.0 / math.sqrt(table.rows)
    out = torch.empty(stop - start, table.dim)
    for block in range(start // BLOCK, -(-stop // BLOCK)):
        first, last = block * BLOCK, min((block + 1) * BLOCK, table.rows)
        generator = torch.Generator().manual_seed(_block_seed(seed, table.name, block))
        rows = torch.empty(last - first, table.dim).uniform_(-bound, bound, generator=generator)
        lo, hi = max(first, start), min(last, stop)
        out[lo - start : hi - start] = rows[lo - first : hi - first]
    return out


def mlp(widths: Sequence[int], last_activation: bool) -> nn.Sequential:
    """Linear layers widths[0] -> widths[1] -> ..., each followed by a ReLU but the last
    (unless `last_activation`)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2 or last_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM's dense part (Naumov et al. 2019, as TorchRec's DLRM): the bottom MLP takes the
    dense features to the tables' width; the interaction takes the pairwise dot products of
    its output and every table's pooled embedding (each pair once, none with itself); the
    top MLP takes them and the bottom output to one logit."""

    def __init__(
        self,
        dense_features: int,
        dim: int,
        tables: Sequence[str],
        bottom: Sequence[int],
        top: Sequence[int],
    ):
        super().__init__()
        self.tables = list(tables)
        self.bottom = mlp([dense_features, *bottom, dim], last_activation=True)
        vectors = len(self.tables) + 1
        pairs = vectors * (vectors - 1) // 2
        self.top = mlp([dim + pairs, *top, 1], last_activation=False)
        i, j = torch.tril_indices(vectors, vectors, offset=-1)
        self.register_buffer("pair_i", i, persistent=False)
        self.register_buffer("pair_j", j, persistent=False)

    def forward(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x, *(pooled[name] for name in self.tables)], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pair_i, self.pair_j]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def call_dense(
    dense: nn.Module,
    recommends: bool,
    values: torch.Tensor,
    pooled: dict[str, torch.Tensor],
    one_table: str,
) -> torch.Tensor:
    """The dense part on a batch: (dense features, {table: pooled}) for a recommendation
    model; the bag's pooled embedding alone for spec.embedding's classifier."""
    return dense(values, pooled) if recommends else dense(pooled[one_table])


def click_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of one logit per sample ((batch,) or (batch, 1)) against clicks,
    in the outputs' precision (float32 labels made a float64 model's loss float32)."""
    return F.binary_cross_entropy_with_logits(outputs.reshape(-1), labels.to(outputs.dtype))


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """The area under the ROC curve: the chance that a random click scores above a random
    non-click, ties counting half (the Mann-Whitney statistic, with mid-ranks). None when
    the labels are not both 0 and 1 or all one class."""
    scores, labels = scores.reshape(-1).double(), labels.reshape(-1).double()
    positives = int((labels == 1).sum())
    negatives = int((labels == 0).sum())
    if positives == 0 or negatives == 0 or positives + negatives != len(labels):
        return None
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    # Mid-ranks: each group of tied scores gets the mean of its ranks.
    sums = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, ranks)
    ranks = (sums / counts)[inverse]
    rank_sum = float(ranks[labels == 1].sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


class Recommender(nn.Module):
    """A HybridJob's whole model in one process: every table an nn.EmbeddingBag (with sparse
    gradients, as the servers step them, but for mode max, which torch's has none for) under
    its name in `tables`, and the dense part `dense`. Its state_dict (`tables.<name>.weight`,
    `dense.<...>`) is the trained model's file for spec.embeddings."""

    def __init__(self, tables: Sequence[Table], dense: nn.Module, seed: int, recommends: bool):
        super().__init__()
        self.features = {t.name: t.feature for t in tables}
        self.recommends = recommends
        self.tables = nn.ModuleDict()
        for t in tables:
            bag = nn.EmbeddingBag(t.rows, t.dim, mode=t.mode, sparse=t.mode != "max")
            with torch.no_grad():
                bag.weight.copy_(initial_rows(t, seed, 0, t.rows))
            self.tables[t.name] = bag
        self.dense = dense

    def forward(
        self, values: torch.Tensor, ids: dict[str, torch.Tensor], offsets: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        pooled = {}
        for name, bag in self.tables.items():
            feature = self.features[name]
            pooled[name] = bag(ids[feature] % bag.num_embeddings, offsets[feature])
        one = next(iter(self.tables))
        return call_dense(self.dense, self.recommends, values, pooled, one)
