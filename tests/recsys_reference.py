"""What a HybridJob trains, in one process: every table an nn.EmbeddingBag of one
`Recommender` module (sparse gradients), the same dense part, and the same sparse optimizer
stepped after each backward, on the batches all the trainers read in a step, together.
The tests compare the servers' tables after a real world's steps against it. `as_dlrm_reads`
reads Criteo lines by itself, as DLRM's preprocessing does, not with pipejob's reader."""

from __future__ import annotations

import math
from collections.abc import Iterator
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
    data = workloads.hybrid_data(spec)
    features = sorted({t.feature for t in spec.embeddings})
    # Each step's whole batch, as the trainers' shares of it together.
    reader = samples.stream(
        data, spec.batch_size * spec.trainers.max, (0, 1), spec.seed, features, spec.recommends
    )
    batches = ((b.dense, b.ids, {f: b.offsets(f) for f in features}, b.labels) for b in reader)
    return trained_on(spec, len(samples.first(data)[0]), batches, steps)


Batch = tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]


def trained_on(
    spec: HybridSpec, dense_features: int, batches: Iterator[Batch], steps: int
) -> tuple[Recommender, torch.optim.Optimizer]:
    """The model after `steps` steps on `batches` (dense, {feature: ids}, {feature: offsets},
    labels), each a step's whole batch; and the tables' optimizer."""
    loss_fn = workloads.loss(spec)
    torch.manual_seed(spec.seed)  # as each trainer seeds its dense part
    dense = workloads.hybrid_dense(spec, dense_features)
    model = Recommender(spec.embeddings, dense, spec.seed, spec.recommends)
    optimizer_class, kwargs = optimizer_args(spec.optimizer)
    dense_optimizer = optimizer_class(dense.parameters(), **kwargs)
    tables = sparse_optimizers.make(list(model.tables.parameters()), spec.sparse_optimizer)
    for _ in range(steps):
        values, ids, offsets, labels = next(batches)
        loss_fn(model(values, ids, offsets), labels).backward()
        for t in spec.embeddings:
            bag = model.tables[t.name]
            if not bag.sparse:  # max: torch has no sparse gradient; the rows looked up count
                touched = torch.unique(ids[t.feature] % t.rows)
                bag.weight.grad = sparse_optimizers.gradient(
                    touched, bag.weight.grad[touched], bag.weight.shape
                )
        for optimizer in (tables, dense_optimizer):
            optimizer.step()
            optimizer.zero_grad()
    return model, tables


def as_dlrm_reads(lines: list[bytes]) -> Batch:
    """Criteo lines (label, I1..I13, C1..C26, tab-separated) as one batch, read as DLRM's
    preprocessing reads them (its data_utils: every empty field is "0"; a negative count is
    0; the counts as log(1 + x); the categorical values hexadecimal, one id a sample),
    in float64, with none of pipejob's code."""
    rows = [line.split(b"\t") for line in lines]
    for row in rows:
        assert len(row) == 40, row
    filled = [[field or b"0" for field in row] for row in rows]
    counts = [[math.log1p(max(int(x), 0)) for x in row[1:14]] for row in filled]
    values = [[int(x, 16) for x in row[14:]] for row in filled]
    ids = {f"C{k + 1}": torch.tensor([v[k] for v in values]) for k in range(26)}
    offsets = {feature: torch.arange(len(lines)) for feature in ids}
    labels = torch.tensor([float(row[0]) for row in filled], dtype=torch.float64)
    return torch.tensor(counts, dtype=torch.float64), ids, offsets, labels


def assembled(pieces: list[dict[str, Any]], table: str, rows: int) -> dict[str, torch.Tensor]:
    """A table's weight and per-row (or per-element) optimizer state whole again, from the
    servers' saved pieces (ps<i>.pt's "pieces"): split by rows or by columns."""
    mine = [p for p in pieces if p["table"] == table]
    columns = sorted({p["column"] for p in mine})
    by_column = [
        sorted((p for p in mine if p["column"] == c), key=lambda p: p["start"]) for c in columns
    ]
    for run in by_column:  # each column slice's rows, 0 to the end, once
        assert [p["start"] for p in run] == [0, *(p["stop"] for p in run[:-1])]
        assert run[-1]["stop"] == rows
    assert [run[0]["column"] for run in by_column[1:]] == [
        run[0]["column"] + run[0]["weight"].shape[1] for run in by_column[:-1]
    ]

    def joined(get: Any) -> torch.Tensor:
        slices = [torch.cat([get(p) for p in run]) for run in by_column]
        return torch.cat(slices, dim=1) if len(slices) > 1 else slices[0]

    out = {"weight": joined(lambda p: p["weight"])}
    for key, value in mine[0]["state"].items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            out[key] = joined(lambda p, key=key: p["state"][key])
    return out
