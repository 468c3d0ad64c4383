"""The torch-free table of the bounds the runtime enforces (core/bounds.py), checked against
torch itself: every bound's edge is accepted by the validation and by the class the trainer
builds (through the trainer's own constructors), every value past it refused by both (or,
where the table says the bound is pipejob's own, refused by the validation and taken by
torch). So `pipejob validate` and the processes cannot drift apart (issue 43)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.testing._internal.distributed.fake_pg import FakeStore

from pipejob.core import bounds, spec
from pipejob.core.kinds.pipeline import PIPELINE_SPEC
from pipejob.core.kinds.pipeline_schedules import SCHEDULES, schedule_refuses
from pipejob.trainer.hybrid import sparse_optimizers
from pipejob.trainer.pipeline.pipelining import schedules as trainer_schedules
from pipejob.trainer.pipeline.stage_base import AUTOCAST
from pipejob.trainer.runtime.optim import OPTIMIZERS, optimizer_args
from pipejob.trainer.workloads.sources import TOKEN_DTYPES

pytestmark = pytest.mark.timeout(120)


def snake(key: str) -> str:
    """The dataclass field of a spec key: weightDecay -> weight_decay."""
    return re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()


def pipeline(**fields: Any) -> dict:
    return {
        "apiVersion": spec.API_VERSION,
        "kind": "PipelineJob",
        "metadata": {"name": "b"},
        "spec": {"stages": 2, "batchSize": 8, **fields},
    }


def hybrid(**fields: Any) -> dict:
    return {
        "apiVersion": spec.API_VERSION,
        "kind": "HybridJob",
        "metadata": {"name": "b"},
        "spec": {"embeddings": [{"name": "a", "rows": 10, "dim": 4}], **fields},
    }


def refused_at(manifest: dict, path: str) -> bool:
    try:
        spec.parse(manifest)
    except spec.InvalidSpec as e:
        return any(error.path == path for error in e.errors)
    return False


def torch_takes(build: Any) -> bool:
    try:
        build()
    except ValueError:
        return False
    return True


def table_cases(table: dict[str, tuple[str, dict[str, bounds.Range]]]):
    return [
        (name, field, bound)
        for name, (_, fields) in table.items()
        for field, bound in fields.items()
    ]


PARAMS = [torch.zeros(10, 4, requires_grad=True)]


@pytest.mark.parametrize(("name", "field", "bound"), table_cases(bounds.OPTIMIZERS))
def test_the_optimizer_bounds_are_torch_optims(name: str, field: str, bound: bounds.Range):
    assert OPTIMIZERS[name].__name__ == bounds.OPTIMIZERS[name][0]

    def build(opt: Any) -> Any:
        cls, kwargs = optimizer_args(opt)
        return cls(PARAMS, **kwargs)

    for edge in bound.inside_edges():
        job = spec.parse(pipeline(optimizer={"name": name, field: edge}))
        assert torch_takes(lambda job=job: build(job.settings.optimizer)), (name, field, edge)
    accepted = spec.parse(pipeline(optimizer={"name": name})).settings.optimizer
    for value, torch_refuses in bound.outside_values():
        assert refused_at(
            pipeline(optimizer={"name": name, field: value}), f"spec.optimizer.{field}"
        ), (name, field, value)
        past = dataclasses.replace(accepted, **{snake(field): value})
        assert torch_takes(lambda past=past: build(past)) != torch_refuses, (name, field, value)


@pytest.mark.parametrize(("name", "field", "bound"), table_cases(bounds.SPARSE_OPTIMIZERS))
def test_the_sparse_optimizer_bounds_are_the_servers(name: str, field: str, bound: bounds.Range):
    accepted = spec.parse(hybrid(sparseOptimizer={"name": name})).settings.sparse_optimizer
    assert (
        type(sparse_optimizers.make(PARAMS, accepted)).__name__ == bounds.SPARSE_OPTIMIZERS[name][0]
    )
    for edge in bound.inside_edges():
        job = spec.parse(hybrid(sparseOptimizer={"name": name, field: edge}))
        opt = job.settings.sparse_optimizer
        assert torch_takes(lambda opt=opt: sparse_optimizers.make(PARAMS, opt)), (name, field, edge)
    for value, torch_refuses in bound.outside_values():
        assert refused_at(
            hybrid(sparseOptimizer={"name": name, field: value}), f"spec.sparseOptimizer.{field}"
        ), (name, field, value)
        past = dataclasses.replace(accepted, **{snake(field): value})
        taken = torch_takes(lambda past=past: sparse_optimizers.make(PARAMS, past))
        assert taken != torch_refuses, (name, field, value)


def test_every_value_the_optimizers_receive_has_a_bound():
    """Each spec field a constructor receives is in the table for each name that passes it."""
    for name in bounds.OPTIMIZERS:
        opt = spec.parse(pipeline(optimizer={"name": name})).settings.optimizer
        # torch takes Adam's betas as one tuple of the spec's beta1 and beta2
        given = {k for k in optimizer_args(opt)[1]} - {"betas"}
        given |= {"beta1", "beta2"} if "betas" in optimizer_args(opt)[1] else set()
        assert given == {snake(f) for f in bounds.OPTIMIZERS[name][1]}, name
    fields = {f.name for f in dataclasses.fields(sparse_optimizers.SparseOptimizer)} - {"name"}
    named = {snake(f) for _, table in bounds.SPARSE_OPTIMIZERS.values() for f in table}
    assert fields == named


def test_the_dtype_names_are_the_trainers():
    precision = PIPELINE_SPEC.fields["precision"].enum
    assert set(bounds.PRECISIONS) == set(precision) == set(AUTOCAST)
    for name, dtype in bounds.PRECISIONS.items():
        assert AUTOCAST[name] == (None if dtype is None else getattr(torch, dtype))
    tokens = PIPELINE_SPEC.fields["data"].fields["tokens"].fields["dtype"].enum
    assert set(bounds.TOKEN_DTYPES) == set(tokens) == set(TOKEN_DTYPES)
    for name, dtype in bounds.TOKEN_DTYPES.items():
        assert np.dtype(TOKEN_DTYPES[name]) == np.dtype(dtype)
    assert refused_at(pipeline(precision="fp64"), "spec.precision")
    assert refused_at(
        pipeline(data={"tokens": {"train": "t", "dtype": "int8"}}), "spec.data.tokens.dtype"
    )


def torch_schedule_takes(schedule: str, stages: int, micro_batches: int) -> bool:
    """Whether torch's class for `schedule` accepts `micro_batches` over `stages` processes
    (one process of a fake group of that size: torch's own checks, nothing sent)."""
    cls = getattr(torch_schedules, bounds.SCHEDULE_CLASSES[schedule])
    per = 2 if schedule in ("interleaved-1f1b", "zero-bubble") else 1
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=stages)
    try:
        held = [
            PipelineStage(torch.nn.Linear(2, 2), k * stages, stages * per, torch.device("cpu"))
            for k in range(per)
        ]
        return torch_takes(
            lambda: cls(
                held[0] if per == 1 else held, micro_batches, loss_fn=lambda out, target: out.sum()
            )
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_micro_batch_rule_is_torchs(schedule: str):
    """1f1b and gpipe: exactly torch's rule. The interleaved schedules: pipejob's is stricter
    (a multiple of stages, what every pinned torch version takes), so each count it accepts
    torch accepts."""
    trainer_class = {**trainer_schedules.SINGLE, **trainer_schedules.MULTI}[schedule]
    assert trainer_class.__name__ == bounds.SCHEDULE_CLASSES[schedule]
    exact = schedule in ("gpipe", "1f1b")
    for stages in (2, 3):
        for micro_batches in range(1, 2 * stages + 2):
            ours = schedule_refuses(schedule, stages, micro_batches) is None
            theirs = torch_schedule_takes(schedule, stages, micro_batches)
            assert ours == theirs if exact else (not ours or theirs), (stages, micro_batches)
