"""What a job trains, behind one small interface: its model, its data and its loss, each
made from the job's typed spec. The trainers (pipeline/, hybrid/) call only these functions,
so a new model, data source or loss is added here and nowhere else.

- PipelineJob: `models.build` (the model; `cut` cuts it into stages), `data` (the training
  feed, the held-out set and a sample to check shapes and measure costs with), `loss`;
- HybridJob: `hybrid_dense` (each trainer's dense model; the tables' rows are
  recsys.initial_rows), `hybrid_data`, `hybrid_held_out` (samples.py), `loss`."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.workloads import imports, label_loss, metrics, recsys, samples
from pipejob.trainer.workloads.samples import Samples

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, labels) -> scalar


def loss(spec: PipelineSpec | HybridSpec) -> Loss:
    """The loss over a whole batch, the mean over its samples: cross-entropy (binary, of one
    logit per sample, for a HybridJob's clicks), or what the user's factory (spec.loss.import,
    called with its args) returns, built here at once (so a bad one fails before anything
    runs) and again wherever it is sent (`UserLoss`)."""
    if spec.loss.cross_entropy is not None:  # spec.loss.crossEntropy's options
        return label_loss.LabelLoss.of(spec.loss.cross_entropy)
    if spec.loss.import_ is None:
        clicks = isinstance(spec, HybridSpec) and spec.recommends
        return recsys.click_loss if clicks else metrics.cross_entropy
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


def hybrid_dense(spec: HybridSpec, dense_features: int) -> nn.Module:
    """A trainer's dense model, from torch's current seed. spec.embedding: nn.Linear from the
    bag's embedding to outFeatures. spec.embeddings: the built-in DLRM over `dense_features`
    dense features and the tables. Or the user's (spec.dense.import with its args)."""
    dense = spec.dense
    if dense.import_ is None:
        if not spec.recommends:
            return nn.Linear(spec.embeddings[0].dim, dense.out_features)
        names = [t.name for t in spec.embeddings]
        return recsys.DLRM(
            dense_features, spec.embeddings[0].dim, names, dense.dlrm.bottom, dense.dlrm.top
        )
    return imports.module(dense.import_, "spec.dense.import", dense.args)


def hybrid_data(spec: HybridSpec) -> Samples:
    """The training samples: synthetic, from files (spec.data.file, spec.data.criteo) or
    from the user's Dataset (spec.data.import); see workloads/samples.py."""
    train = samples.split_samples(spec, "train")
    assert train is not None  # every source has a training split
    return train


def hybrid_held_out(spec: HybridSpec) -> Samples | None:
    """The held-out samples spec.eval measures on; None when the data has none."""
    return samples.split_samples(spec, "val")
