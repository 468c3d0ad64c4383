"""What a job trains, behind one small interface: its model, its data and its loss, each
made from the job's typed spec. The trainers (pipeline/, hybrid/) call only these functions,
so a new model, data source or loss is added here and nowhere else.

- PipelineJob: `pipeline_layers` (the model cut into layers a stage holds runs of),
  `sample_input` (a micro-batch to measure layer costs with), `pipeline_data`, `loss`;
- HybridJob: `hybrid_table` (the parameter server's EmbeddingBag), `hybrid_dense` (each
  trainer's dense model), `hybrid_data`, `loss`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.workloads.synthetic import SyntheticBags, SyntheticImages
from pipejob.trainer.workloads.torchvision import Layer, build_model, cut

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, labels) -> scalar


def loss(spec: PipelineSpec | HybridSpec) -> Loss:
    """The loss over a whole batch, the mean over its samples: both kinds classify."""
    return F.cross_entropy


def pipeline_layers(spec: PipelineSpec) -> list[Layer]:
    """The model, seeded, as named layers whose composition is its forward."""
    torch.manual_seed(spec.seed)
    return cut(build_model(spec.model, spec.num_classes))


def sample_input(spec: PipelineSpec, batch: int) -> torch.Tensor:
    """A batch of `batch` inputs of the model's shape, to measure what each layer costs."""
    return torch.randn(batch, 3, spec.image_size, spec.image_size)


def pipeline_data(spec: PipelineSpec) -> SyntheticImages:
    """A step's whole batch: one share of `batchSize` per replica, in replica order."""
    batch = spec.batch_size * spec.replicas
    return SyntheticImages(spec.seed, batch, spec.image_size, spec.num_classes)


def hybrid_table(spec: HybridSpec) -> nn.EmbeddingBag:
    """The parameter server's table, seeded on its own (the same in every restart)."""
    emb = spec.embedding
    table = nn.EmbeddingBag(emb.num_embeddings, emb.dim, mode=emb.mode)
    nn.init.normal_(table.weight, generator=torch.Generator().manual_seed(spec.seed))
    return table


def hybrid_dense(spec: HybridSpec) -> nn.Module:
    """A trainer's dense model on the bags' embeddings, from torch's current seed."""
    return nn.Linear(spec.embedding.dim, spec.dense.out_features)


def hybrid_data(spec: HybridSpec) -> SyntheticBags:
    return SyntheticBags(
        size=spec.dataset_size,
        num_embeddings=spec.embedding.num_embeddings,
        classes=spec.dense.out_features,
        bag_size=spec.bag_size,
        seed=spec.seed,
    )
