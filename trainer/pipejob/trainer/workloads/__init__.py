"""What a job trains, behind one small interface: its model, its data and its loss, each
made from the job's typed spec. The trainers (pipeline/, hybrid/) call only these functions,
so a new model, data source or loss is added here and nowhere else.

- PipelineJob: `models.build` (the model; `cut` cuts it into stages), `data` (the training
  feed, the held-out set and a sample to check shapes and measure costs with), `loss`;
- HybridJob: `hybrid_table` (the parameter server's EmbeddingBag), `hybrid_dense` (each
  trainer's dense model), `hybrid_data`, `hybrid_held_out`, `loss`."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.workloads import bags, imports, metrics
from pipejob.trainer.workloads.bags import Bags

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, labels) -> scalar


def loss(spec: PipelineSpec | HybridSpec) -> Loss:
    """The loss over a whole batch, the mean over its samples: cross-entropy, or what the
    user's factory (spec.loss.import, called with its args) returns, built here at once (so
    a bad one fails before anything runs) and again wherever it is sent (`UserLoss`)."""
    if spec.loss.import_ is None:
        return metrics.cross_entropy
    user = UserLoss(spec.loss.import_, json.dumps(spec.loss.args, sort_keys=True))
    _made(user)
    return user


@dataclass(frozen=True)
class UserLoss:
    """The user's loss by its spec's words: what crosses RPC to the last stage, which builds
    it there once (the object the factory returns need not pickle)."""

    path: str
    args: str  # spec.loss.args as JSON

    def __call__(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _made(self)(outputs, labels)


@functools.cache
def _made(user: UserLoss) -> Loss:
    made = imports.call(user.path, "spec.loss.import", json.loads(user.args))
    if not callable(made):
        raise TypeError(
            f"spec.loss.import: {user.path!r} returned a"
            f" {type(made).__name__}, not a callable (outputs, labels) -> loss"
        )
    return made


def hybrid_table(spec: HybridSpec) -> nn.EmbeddingBag:
    """The parameter server's table, seeded on its own (the same in every restart)."""
    emb = spec.embedding
    table = nn.EmbeddingBag(emb.num_embeddings, emb.dim, mode=emb.mode)
    nn.init.normal_(table.weight, generator=torch.Generator().manual_seed(spec.seed))
    return table


def hybrid_dense(spec: HybridSpec) -> nn.Module:
    """A trainer's dense model on the bags' embeddings (batch, embedding.dim), from torch's
    current seed: nn.Linear to outFeatures, or the user's (spec.dense.import with its args)."""
    dense = spec.dense
    if dense.import_ is None:
        return nn.Linear(spec.embedding.dim, dense.out_features)
    made = imports.call(dense.import_, "spec.dense.import", dense.args)
    if not isinstance(made, nn.Module):
        raise TypeError(f"spec.dense.import: {dense.import_!r} returned a"
                        f" {type(made).__name__}, not an nn.Module")  # fmt: skip
    return made


def hybrid_data(spec: HybridSpec) -> Bags:
    """The training bags: synthetic, from .npz files (spec.data.file) or from the user's
    Dataset (spec.data.import); see workloads/bags.py."""
    train = bags.data(spec, "train")
    assert train is not None  # every source has a training split
    return train


def hybrid_held_out(spec: HybridSpec) -> Bags | None:
    """The held-out bags spec.eval measures on; None when the data has none."""
    return bags.data(spec, "val")
