"""The staged path (spec.model.staged, workloads/staged.py): a model no tracer reads trains
because its user says how it is staged, as modules called in turn (`layers`) or as a function
building stage i of n (`stage`). A GRU over packed sequences, which the cut refuses, and the
seeds' ResNet-50 shards (tiny): step 1's loss and every gradient equal one process's in
float64 (in this process, each stage built as its stage process builds it and pickled as
shipped), the stages hold the model's own names and their states load strictly into it; a
real world trains the GRU to its end on the pipelining engine, evaluates, checkpoints and
writes its output, and a second world resumes the checkpoint on the rpc engine."""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from userpkg import staged as users

from jobrun import (
    EXACT,
    TOLERANCE,
    assert_gradient_close,
    check_gradients,
    pipeline_job,
    run_to_end,
)
from pipejob.core import spec
from pipejob.trainer.pipeline.cut_model import plan_cut
from pipejob.trainer.pipeline.stage_build import PieceBuilder, trace
from pipejob.trainer.workloads import cut, models, staged
from pipejob.trainer.workloads.cut import join
from pipejob.trainer.workloads.metrics import cross_entropy

pytestmark = pytest.mark.timeout(240)

GRU = {"import": "userpkg.staged:PackedGRU", "staged": {"stage": "userpkg.staged:gru_stage"}}
TINY = {"width": 8, "blocks": [1, 1, 1, 1], "num_classes": 10}
SHARDS_AS_LAYERS = {
    "import": "userpkg.staged:ResNetShards",
    "args": TINY,
    "staged": {"layers": ["shard1", "shard2"]},
}
SHARDS_BUILT = {"staged": {"stage": "userpkg.staged:resnet_shard"}, "args": TINY}
PADDED = {"import": "userpkg.staged:padded"}


def settings(model: dict[str, Any], **fields: Any) -> Any:
    return spec.parse(pipeline_job("staged", model=model, **fields)).settings


def built_stages(s: Any) -> list[nn.Module]:
    """Each stage as its process builds it from the master's plan, pickled as shipped."""
    cut_model = plan_cut(s, *models.build_meta(s), [], partition_saved(s))
    assert cut_model.builders is not None
    return [
        pickle.loads(pickle.dumps(piece))
        for builder in cut_model.builders
        for piece in builder.build()
    ]


def partition_saved(s: Any) -> Any:
    """One piece per stage, as a checkpoint's partition (no stage processes to measure)."""
    from pipejob.trainer.pipeline.cut_model import Partition

    units = trace(s, models.build_meta(s)[0]).units
    n = len(units)
    bounds = [k * n // s.pieces for k in range(s.pieces)] + [n]
    return Partition([range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)], [1.0] * n, 2)


def step_one(
    s: Any, x: torch.Tensor, y: torch.Tensor
) -> tuple[list[nn.Module], float, nn.Module, float]:
    """Step 1's forward and backward through the stages (2 micro-batches) and through the
    whole model in one process, both in float64."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(EXACT)
    try:
        stages = built_stages(s)
        outputs = []
        for part in x.tensor_split(2):
            values: Any = (part,)
            for stage in stages:
                values = stage(*values)
            outputs.append(values)
        loss = cross_entropy(join(outputs), y)
        loss.backward()
        model = models.build(s)
        expected = cross_entropy(join([model(p) for p in x.tensor_split(2)]), y)
        expected.backward()
    finally:
        torch.set_default_dtype(default)
    return stages, loss.item(), model, expected.item()


def assert_exact(stages: list[nn.Module], loss: float, model: nn.Module, expected: float) -> None:
    assert loss == pytest.approx(expected, rel=TOLERANCE)
    grads = {k: p.grad for s in stages for k, p in s.named_parameters()}
    params = dict(model.named_parameters())
    assert sorted(grads) == sorted(params)  # the model's own names
    for name, p in params.items():
        assert_gradient_close(name, grads[name], p.grad)
    state = {k: v for s in stages for k, v in s.state_dict().items()}
    model.load_state_dict(state, strict=True)  # the stages' states are the model's


def test_the_tracer_refuses_the_packed_gru():
    with pytest.raises(cut.CutError, match="pack_padded_sequence"):
        cut.Traced(users.PackedGRU(), want=4)


def test_a_packed_gru_staged_by_a_function_is_exact():
    s = settings(GRU, data=PADDED, batchSize=8, numClasses=3)
    data = users.Padded()
    x, y = data.tokens[:8], data.labels[:8]
    stages, loss, model, expected = step_one(s, x, y)
    assert [type(stage).__name__ for stage in stages] == ["Adopted", "Adopted"]
    assert_exact(stages, loss, model, expected)


@pytest.mark.parametrize("model", [SHARDS_AS_LAYERS, SHARDS_BUILT], ids=["layers", "stage"])
def test_the_seeds_resnet_shards_staged_either_way_are_exact(model: dict[str, Any]):
    s = settings(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(10, (4,), generator=g)
    stages, loss, whole, expected = step_one(s, x.double(), y)
    names = [n for stage in stages for n in stage.state_dict()]
    second = "shard2." if "import" in model else "1."  # without import: 0.seq..., 1.fc...
    assert all(n.startswith(second) for n in stages[1].state_dict()), names
    assert_exact(stages, loss, whole, expected)


def test_layers_open_plain_containers_and_balance_between_them():
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(4, 8))
    model.add_module("blocks", nn.ModuleList(nn.Linear(8, 8) for _ in range(4)))
    model.add_module("head", nn.Linear(8, 2))
    assert staged.units(model, ["embed", "blocks", "head"]) == [
        "embed",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "head",
    ]
    layers = staged.Layers(model, ["embed", "blocks", "head"])
    first, second = layers.split(["blocks.2"])
    x = torch.randn(3, 4)
    out = second(*first(x))
    expected = model.head(
        model.blocks[3](model.blocks[2](model.blocks[1](model.blocks[0](model.embed(x)))))
    )
    torch.testing.assert_close(out, expected)
    assert sorted([*first.state_dict(), *second.state_dict()]) == sorted(model.state_dict())
    with pytest.raises(cut.CutError, match="'decoder' is not a module"):
        staged.units(model, ["embed", "decoder"])
    with pytest.raises(cut.CutError, match="inside blocks"):
        staged.units(model, ["blocks", "blocks.1"])


def test_a_stage_under_other_names_than_the_whole_model_is_refused():
    s = settings(
        {"import": "userpkg.staged:PackedGRU", "staged": {"stage": "userpkg.staged:resnet_shard"}}
    )
    meta, _ = models.build_meta(s)
    with pytest.raises(cut.CutError, match="under the whole model's names"):
        trace(s, meta).split(["resnet_shard(1)"])


def gru_job(out: Path, ckpt: Path, engine: str, steps: int) -> dict[str, Any]:
    return pipeline_job(
        "gru",
        model=GRU,
        data=PADDED,
        batchSize=8,
        numClasses=3,
        microBatches=2,
        steps=steps,
        engine=engine,
        eval={"batches": 1},
        output={"path": str(out)},
        checkpoint={"path": str(ckpt), "everySteps": 2},
    )


def test_a_packed_gru_trains_evaluates_and_writes_in_a_world(tmp_path: Path, monkeypatch):
    """A real world on the pipelining engine: 2 steps, evaluation, a checkpoint and the
    output, which loads strictly into the model."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    out, ckpt = tmp_path / "model", tmp_path / "ckpt"
    code, said, summary = run_to_end(gru_job(out, ckpt, "pipelining", 2), tmp_path, timeout=200)
    assert code == 0, said[-3000:]
    assert summary is not None and math.isfinite(summary["evaluation"]["loss"]), summary
    users.PackedGRU().load_state_dict(load_file(out / "model.safetensors"), strict=True)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_staged_checkpoint_resumes_on_the_other_engine(tmp_path: Path, monkeypatch):
    """The pipelining engine's checkpoint at step 2, resumed by the rpc engine to step 3."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    out, ckpt = tmp_path / "model", tmp_path / "ckpt"
    code, said, _ = run_to_end(gru_job(out, ckpt, "pipelining", 2), tmp_path, timeout=200)
    assert code == 0, said[-3000:]
    code, said, summary = run_to_end(gru_job(out, ckpt, "rpc", 3), tmp_path, timeout=200)
    assert code == 0, said[-3000:]
    assert "resumed from step 2" in said, said[-3000:]
    assert summary is not None and summary["resumedFromStep"] == 2, summary
    users.PackedGRU().load_state_dict(load_file(out / "model.safetensors"), strict=True)


def test_a_part_of_a_stage_function_builds_only_its_own_stage():
    s = settings(GRU, data=PADDED)
    part = PieceBuilder(s, torch.float32, (), ("gru_stage(1)",), (1,))
    (head,) = part.build()
    assert sorted(head.state_dict()) == ["head.bias", "head.weight"]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_layers_checkpoint_resumes_on_another_cut(tmp_path: Path, monkeypatch):
    """Staged as layers, 2 stages to step 2, then 3 stages resuming it (names are the
    model's, so any cut of the layers resumes any checkpoint)."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    ckpt = tmp_path / "ckpt"
    model = {
        "import": "userpkg.staged:Layered",
        "staged": {"layers": ["embed", "blocks", "pool", "head"]},
    }
    job = pipeline_job(
        "layered",
        model=model,
        data=PADDED,
        batchSize=8,
        numClasses=3,
        microBatches=2,
        steps=2,
        checkpoint={"path": str(ckpt), "everySteps": 2},
    )
    code, said, _ = run_to_end(job, tmp_path, timeout=200)
    assert code == 0, said[-3000:]
    job["spec"] |= {"steps": 3, "stages": 3}
    code, said, summary = run_to_end(job, tmp_path, timeout=200)
    assert code == 0, said[-3000:]
    assert "resumed from step 2" in said and "written by 2 stages" in said, said[-3000:]
    assert summary is not None and summary["resumedFromStep"] == 2, summary


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("engine,replicas", [("rpc", 1), ("pipelining", 2)])
def test_a_staged_gru_step_through_a_world_equals_one_process(
    engine: str, replicas: int, tmp_path: Path
):
    """Step 1 through real stage processes on each engine (the pipelining one with 2
    replicas, their gradients averaged), against one process (float64)."""
    job = spec.parse(
        pipeline_job(
            "gru",
            model=GRU,
            data=PADDED,
            batchSize=8,
            numClasses=3,
            microBatches=2,
            engine=engine,
            replicas=replicas,
        )
    )
    got = check_gradients(job, tmp_path, timeout=400)  # spawned worlds: minutes on 2 cores
    assert got["stages"] == [["gru_stage(0)"], ["gru_stage(1)"]]
