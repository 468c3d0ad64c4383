"""What a HybridJob trains, in one process: every table an nn.EmbeddingBag of one
`Recommender` module (sparse gradients), the same dense part, and the same sparse optimizer
stepped after each backward, on the batches all the trainers read in a step, together.
The tests compare the servers' tables after a real world's steps against it."""

from __future__ import annotations

from typing import Any

import torch

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.trainer import workloads
from pipejob.trainer.hybrid import sparse_optimizers
from pipejob.trainer.runtime.optim import optimizer_args
from pipejob.trainer.workloads import samples
from pipejob.trainer.workloads.recsys import Recommender


def trained(spec: HybridSpec, steps: int) -> tuple[Recommender, torch.optim.Optimizer]:
    """The model after `steps` steps, and the tables' optimizer (for its state)."""
    data, loss_fn = workloads.hybrid_data(spec), workloads.loss(spec)
    torch.manual_seed(spec.seed)  # as each trainer seeds its dense part
    dense = workloads.hybrid_dense(spec, len(samples.first(data)[0]))
    model = Recommender(spec.embeddings, dense, spec.seed, spec.recommends)
    optimizer_class, kwargs = optimizer_args(spec.optimizer)
    dense_optimizer = optimizer_class(dense.parameters(), **kwargs)
    tables = sparse_optimizers.make(list(model.tables.parameters()), spec.sparse_optimizer)
    features = sorted({t.feature for t in spec.embeddings})
    # Each step's whole batch, as the trainers' shares of it together.
    reader = samples.stream(
        data, spec.batch_size * spec.trainers.max, (0, 1), spec.seed, features, spec.recommends
    )
    for _ in range(steps):
        batch = next(reader)
        offsets = {f: batch.offsets(f) for f in features}
        loss_fn(model(batch.dense, batch.ids, offsets), batch.labels).backward()
        for t in spec.embeddings:
            bag = model.tables[t.name]
            if not bag.sparse:  # max: torch has no sparse gradient; the rows looked up count
                touched = torch.unique(batch.ids[t.feature] % t.rows)
                bag.weight.grad = sparse_optimizers.gradient(
                    touched, bag.weight.grad[touched], bag.weight.shape
                )
        for optimizer in (tables, dense_optimizer):
            optimizer.step()
            optimizer.zero_grad()
    return model, tables


def assembled(pieces: list[dict[str, Any]], table: str, rows: int) -> dict[str, torch.Tensor]:
    """A table's weight and per-row optimizer state whole again, from the servers' saved
    pieces (ps<i>.pt's "pieces")."""
    mine = sorted((p for p in pieces if p["table"] == table), key=lambda p: p["start"])
    assert [p["start"] for p in mine] == [0, *(p["stop"] for p in mine[:-1])]
    assert mine[-1]["stop"] == rows
    out = {"weight": torch.cat([p["weight"] for p in mine])}
    for key, value in mine[0]["state"].items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            out[key] = torch.cat([p["state"][key] for p in mine])
    return out
