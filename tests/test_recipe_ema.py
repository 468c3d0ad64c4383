"""spec.ema (issue 58): each stage's exponential moving average of its own parameters equals
one process's EMA of the whole model (float64), through a checkpoint resumed on another cut,
and in a world of stages driven by the master (both engines' StageBase), swapped in for the
output. The one-process EMA is written out here as the formula the spec states."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from test_recipes import CUTS, LAYERS, mlp
from torch import nn

from jobrun import master_of, pipeline_job, run_world
from pipejob.core import plan, spec
from pipejob.runner.local import LOOPBACK, free_ports
from pipejob.trainer.pipeline import ema_stages, replicas_class
from pipejob.trainer.pipeline.cut_model import CutModel, Partition
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.workloads import cut

STEPS = 7
EMA = {"decay": 0.8, "everySteps": 2, "warmup": 2}
OPTIMIZER = {"name": "adamw", "lr": 0.05, "weightDecay": 0.01}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randint(3, (8,), generator=g))
        for _ in range(STEPS)
    ]


def one_process(model: nn.Module, settings: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model trained STEPS steps by torch.optim.AdamW, and the EMA as spec.ema says: the
    initial weights; after step k, the weights while k <= warmup, else on every everySteps-th
    step decay * average + (1 - decay) * weights."""
    o = OPTIMIZER
    optimizer = torch.optim.AdamW(model.parameters(), lr=o["lr"], weight_decay=o["weightDecay"])
    average = {n: p.detach().clone() for n, p in model.named_parameters()}
    d, every, warmup = settings["decay"], settings["everySteps"], settings["warmup"]
    for k, (x, y) in enumerate(batches(), start=1):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        for n, p in model.named_parameters():
            if k <= warmup:
                average[n] = p.detach().clone()
            elif (k - warmup) % every == 0:
                average[n] = d * average[n] + (1 - d) * p.detach()
    return average


def stages_of(model: nn.Module, count: int) -> list[StageBase]:
    """`model` cut into `count` stages in this process, each averaging its parameters."""
    job = spec.parse(pipeline_job("ema", stages=count, optimizer=OPTIMIZER, ema=EMA)).settings
    pieces = cut.Traced(model).split(CUTS[count])
    out = [StageBase(piece, "cpu", optimizer=job.optimizer) for piece in pieces]
    for held in out:
        held.keep_average(job.ema)
    return out


def test_the_stages_average_equals_one_process_through_a_resume_on_another_cut(tmp_path: Path):
    """Steps 1..3 on 2 stages, a checkpoint, steps 4..7 on 3 stages of a model built afresh
    (other weights: the checkpoint must give them and their average), against one process."""
    reference = mlp()  # the gradients of each step, and its EMA
    want = one_process(mlp(), EMA)
    stages, entries = stages_of(mlp(), 2), []
    for k, (x, y) in enumerate(batches(), start=1):
        if k == 4:  # the resume: each name from whichever file holds it
            entries = [s.save(str(tmp_path), f"stage{i}.pt") for i, s in enumerate(stages)]
            fresh = mlp()
            with torch.no_grad():
                for p in fresh.parameters():
                    p.add_(1.0)
            stages = stages_of(fresh, 3)
            for s in stages:
                s.load(str(tmp_path), entries, seed=0)
        state = {n: v for s in stages for n, v in s.state().items()}
        reference.load_state_dict(state)
        F.cross_entropy(reference(x), y).backward()
        grads = {n: p.grad for n, p in reference.named_parameters()}
        reference.zero_grad()
        for s in stages:
            s.step_optimizer({n: grads[n] for n in s.parameters_by_name}, None)
    weights = {n: v.clone() for s in stages for n, v in s.state().items()}
    for s in stages:
        s.swap_average()
    got = {n: v for s in stages for n, v in s.state().items()}
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-12, msg=name)
    # the weights and the average differ: the test compares the average
    assert not torch.allclose(weights["fc1.weight"], got["fc1.weight"], atol=1e-4)


def _ema_world(rank: int, envs: list[dict[str, str]], out: str) -> None:
    if (env := master_of(rank, envs)) is None:
        return
    try:
        s = env.spec
        traced = cut.Traced(mlp())
        starts = [0, *(LAYERS.index(c) for c in CUTS[s.stages]), len(LAYERS)]
        ranges = [range(a, b) for a, b in zip(starts, starts[1:], strict=False)]
        stages = traced.split(CUTS[s.stages])
        cut_model = CutModel(traced.units, stages, Partition(ranges, [1.0] * len(LAYERS), 2), {})
        replicas = replicas_class(s)([env.names("stage")], cut_model, s)
        ema_stages.keep(s, replicas)
        for step, batch in enumerate(batches()):
            replicas.step(2, step, F.cross_entropy, batch)
        pipe = replicas.pipelines[0]
        with ema_stages.swapped(pipe):
            average = {
                k: v for part in pipe.stage_results(StageBase.state) for k, v in part.items()
            }
        weights = {k: v for part in pipe.stage_results(StageBase.state) for k, v in part.items()}
        torch.save({"average": average, "weights": weights}, out)
    finally:
        rpc.shutdown()


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "engine_fields",
    # slow: the numbers are held in one process (the resume test above, through StageBase), the
    # world's path (keep, update, swap, checkpoint) by the `pipejob run` test below.
    [
        pytest.param({"engine": "rpc"}, marks=pytest.mark.slow),
        pytest.param({"engine": "pipelining", "schedule": "1f1b"}, marks=pytest.mark.slow),
    ],
    ids=["rpc", "pipelining"],
)
def test_a_worlds_average_equals_one_process(tmp_path: Path, engine_fields: dict[str, str]):
    job = spec.parse(
        pipeline_job(
            "ema",
            stages=2,
            microBatches=2,
            steps=STEPS,
            optimizer=OPTIMIZER,
            ema=EMA,
            **engine_fields,
        )
    )
    ports = free_ports(6)
    processes = plan.plan_world(
        job, lambda m: LOOPBACK, plan.Ports(*ports[:4], groups=tuple(ports[4:]))
    )
    got = run_world(_ema_world, [p.env for p in processes], tmp_path / "ema.pt")
    model = mlp()
    want = one_process(model, EMA)
    for name, value in want.items():
        torch.testing.assert_close(got["average"][name], value, rtol=1e-9, atol=1e-12, msg=name)
        torch.testing.assert_close(  # swapped back: the weights train on
            got["weights"][name], model.state_dict()[name], rtol=1e-9, atol=1e-12, msg=name
        )


def refusals(**fields: Any) -> list[str]:
    with pytest.raises(spec.InvalidSpec) as refused:
        spec.parse(pipeline_job("bad", **fields))
    return [str(e) for e in refused.value.errors]


def test_bad_ema_settings_are_refused_naming_the_field():
    (one,) = refusals(ema={"decay": 1})
    assert one.startswith("spec.ema.decay: must be < 1")
    (zero,) = refusals(ema={"decay": 0})
    assert zero.startswith("spec.ema.decay: must be > 0")
    (every,) = refusals(ema={"everySteps": 0})
    assert every.startswith("spec.ema.everySteps: must be >= 1")
    (warmup,) = refusals(ema={"warmup": -1})
    assert warmup.startswith("spec.ema.warmup: must be >= 0")
    (output,) = refusals(ema={"output": "weights"})
    assert output.startswith("spec.ema.output: must be one of ema, both")
    hybrid = {
        "apiVersion": spec.API_VERSION,
        "kind": "HybridJob",
        "metadata": {"name": "bad"},
        "spec": {"ema": {"decay": 0.9}},
    }
    with pytest.raises(spec.InvalidSpec) as refused:
        spec.parse(hybrid)
    assert str(refused.value.errors[0]).startswith("spec.ema: unknown field")


# ------------------------------------------------- `pipejob run`: evaluation and the output


def test_a_run_evaluates_both_and_writes_the_weights_and_the_average(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A user's CNN on the digits, `pipejob run`: each evaluation reports the average's
    figures beside the weights'; output.path holds the weights and ema/ the average, each
    equal to what the last checkpoint keeps (its model, and its "ema" state by name)."""
    from safetensors.torch import load_file
    from userdata import write_digits

    from jobrun import final_state, run_to_end

    train, val = write_digits(tmp_path / "digits")
    out, ckpt = tmp_path / "model", tmp_path / "checkpoints"
    manifest = pipeline_job(
        "ema",
        model={"import": "userpkg.vision:small_cnn", "args": {"classes": 10}},
        data={"imageFolder": {"train": str(train), "val": str(val)}},
        eval={"everySteps": 3, "batches": 2},
        output={"path": str(out)},
        checkpoint={"path": str(ckpt), "everySteps": 3},
        ema={"decay": 0.5, "output": "both"},
        stages=2,
        microBatches=2,
        steps=6,
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9},
    )
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # userpkg, for every process
    code, log, summary = run_to_end(manifest, tmp_path, timeout=240)
    assert code == 0, log[-3000:]
    assert "eval step 3: loss " in log and "; ema: loss " in log, log[-3000:]
    assert summary is not None
    evaluation = summary["evaluation"]
    assert evaluation["ema"]["loss"] != evaluation["loss"]
    saved = by_name(final_state(ckpt, 6))
    weights = load_file(out / "model.safetensors")
    average = load_file(out / "ema" / "model.safetensors")
    assert sorted(weights) == sorted(average) == sorted(saved["model"])
    for name, value in saved["model"].items():
        assert torch.equal(weights[name], value), name
        if name in saved["ema"]:  # a parameter (buffers are the model's own)
            assert torch.equal(average[name], saved["ema"][name]), name
    assert saved["ema"] and all(not torch.equal(weights[n], average[n]) for n in saved["ema"])


def by_name(state: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """A checkpoint's stage files merged: the model's state and each parameter's average."""
    model, average = {}, {}
    for name, part in state.items():
        if name.startswith("stage"):
            model |= part["model"]
            average |= {n: s["ema"] for n, s in part["optimizers"]["ema"].items()}
    return {"model": model, "ema": average}
