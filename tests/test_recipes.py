"""Training recipes of a PipelineJob (issue 21): the learning-rate schedule, exact global
gradient clipping across stages and replicas, gradient accumulation, and their validation.

The exactness tests run a real world (the trainer's own stage role in spawned processes, the
master driving the trainer's ReplicasBase) on a float64 MLP and compare every step with plain
autograd in one process: torch.nn.utils.clip_grad_norm_ over the whole model, the schedule's
learning rate, and the batch that accumulation adds up to. float64, because the pipeline sums
the same gradients in another order (per stage, per round, through the all-reduce), and in
float64 that reordering stays near 1e-16 of the magnitudes involved (about 1): rtol 1e-9 leaves
a wide margin over three steps, while any error in the algorithm (one stage's norm, a missed
1/N, the wrong step's lr) changes the parameters by 1e-3 or more."""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn

from jobrun import master_of, pipeline_job, run_to_end, run_world
from pipejob.core import plan, spec
from pipejob.core.optimizer import Optimizer, Schedule
from pipejob.runner.local import LOOPBACK, free_ports
from pipejob.trainer.pipeline import replicas_class
from pipejob.trainer.pipeline.cut_model import CutModel, Partition
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.runtime import checkpoint
from pipejob.trainer.runtime.optim import learning_rate
from pipejob.trainer.workloads import cut

STEPS, SHARE = 3, 6  # optimizer steps; samples per replica per batch
# Clipping at 0.05 is active in every step (the test checks that the norm exceeds it); SGD
# with momentum and weight decay, whose update is linear in the clipped gradient and the lr.
OPTIMIZER = {
    "name": "sgd",
    "lr": 0.2,
    "momentum": 0.9,
    "weightDecay": 0.001,
    "clipGradNorm": 0.05,
    "schedule": {"warmupSteps": 2, "decay": "cosine", "minLr": 0.02},
}
LAYERS = ["fc1", "act1", "fc2", "act2", "fc3"]
CUTS = {2: ["fc2"], 3: ["fc2", "fc3"]}


def mlp(tied: bool = False) -> nn.Sequential:
    """No batch statistics, no Dropout: every sample's gradient is its own. `tied`: fc3 shares
    fc2's weight (as tied embeddings do), which 3 stages cut apart: the one tensor must count
    once in the global norm, as clip_grad_norm_ counts it in one process."""
    torch.manual_seed(7)
    model = nn.Sequential(
        OrderedDict(
            [
                ("fc1", nn.Linear(5, 16)),
                ("act1", nn.Tanh()),
                ("fc2", nn.Linear(16, 16)),
                ("act2", nn.Tanh()),
                ("fc3", nn.Linear(16, 16 if tied else 3)),
            ]
        )
    ).double()
    if tied:
        model.fc3.weight = model.fc2.weight
    return model


def tied(stages: int) -> bool:
    """The 3-stage runs train the tied model: fc2 on stage 1, fc3 on stage 2."""
    return stages == 3


def batches(samples: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's whole batch: every replica's share of every accumulated batch."""
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(samples, 5, generator=g, dtype=torch.float64),
            torch.randint(3, (samples,), generator=g),
        )
        for _ in range(STEPS)
    ]


def _recipe_world(rank: int, envs: list[dict[str, str]], out: str) -> None:
    if (env := master_of(rank, envs)) is None:
        return
    try:
        s = env.spec
        names = env.names("stage")
        per_replica = [names[r * s.stages : (r + 1) * s.stages] for r in range(s.replicas.max)]
        traced = cut.Traced(mlp(tied(s.stages)))
        starts = [0, *(LAYERS.index(c) for c in CUTS[s.stages]), len(LAYERS)]
        ranges = [range(a, b) for a, b in zip(starts, starts[1:], strict=False)]
        stages = traced.split(CUTS[s.stages])
        cut_model = CutModel(
            traced.units,
            stages,
            Partition(ranges, [1.0] * len(LAYERS), 2),
            {},
            tied=cut.ties(stages),
        )
        replicas = replicas_class(s)(per_replica, cut_model, s)
        samples = SHARE * s.replicas.max * s.gradient_accumulation
        results = [
            replicas.step(2, step, F.cross_entropy, batch)
            for step, batch in enumerate(batches(samples))
        ]
        states = [
            {k: v for part in p.stage_results(StageBase.state) for k, v in part.items()}
            for p in replicas.pipelines
        ]
        torch.save(
            {"results": [(r.loss, r.lr, r.grad_norm) for r in results], "states": states}, out
        )
    finally:
        rpc.shutdown()


def cosine_lr(step: int) -> float:
    """OPTIMIZER's schedule written out: warmup 0.1, 0.2, then half a cosine from 0.2 towards
    0.02 over the remaining steps (3 - 2 = 1: step 2 is at its start)."""
    return [0.2 * 1 / 2, 0.2 * 2 / 2, 0.02 + (0.2 - 0.02) * 0.5 * (1 + math.cos(0))][step]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("stages", "replicas", "accumulation", "engine_fields"),
    # The replicated rpc world and the tied, accumulating pipelining one hold the others.
    [
        pytest.param(2, 1, 1, {"engine": "rpc"}, marks=pytest.mark.slow),
        pytest.param(3, 1, 2, {"engine": "rpc"}, marks=pytest.mark.slow),
        (2, 2, 2, {"engine": "rpc"}),
        (3, 1, 2, {"engine": "pipelining", "schedule": "gpipe"}),
        pytest.param(2, 2, 2, {"engine": "pipelining", "schedule": "1f1b"}, marks=pytest.mark.slow),
        pytest.param(2, 1, 2, {"engine": "pipelining", "schedule": "1f1b"}, marks=pytest.mark.slow),
    ],
    ids=[
        "2-stages",
        "3-stages-tied-accumulating-2",
        "2-replicas-accumulating-2",
        "pipelining-3-stages-tied-accumulating-2",
        "pipelining-2-replicas-accumulating-2",
        "pipelining-2-stages-accumulating-2",
    ],
)
def test_a_clipped_scheduled_step_equals_one_process(
    tmp_path: Path, stages: int, replicas: int, accumulation: int, engine_fields: dict[str, str]
) -> None:
    job = spec.parse(
        pipeline_job(
            "recipe",
            stages=stages,
            replicas=replicas,
            microBatches=2,
            gradientAccumulation=accumulation,
            steps=STEPS,
            optimizer=OPTIMIZER,
            **engine_fields,
        )
    )
    ports = free_ports(4 + stages)  # and one for each group (at most one per stage)
    world_ports = plan.Ports(*ports[:4], groups=tuple(ports[4:]))
    processes = plan.plan_world(job, lambda m: LOOPBACK, world_ports)
    got = run_world(_recipe_world, [p.env for p in processes], tmp_path / "recipe.pt")

    # The reference: the whole step's batch (every replica's share of every accumulated batch)
    # in one backward, clip_grad_norm_ over the whole model, the schedule's lr, one optimizer.
    model = mlp(tied(stages))
    o = OPTIMIZER
    optimizer = torch.optim.SGD(
        model.parameters(), lr=o["lr"], momentum=o["momentum"], weight_decay=o["weightDecay"]
    )
    expected = []
    for step, (x, y) in enumerate(batches(SHARE * replicas * accumulation)):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), o["clipGradNorm"]).item()
        assert norm > 2 * o["clipGradNorm"], "the test must clip"
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step)
        optimizer.step()
        optimizer.zero_grad()
        expected.append((loss.item(), cosine_lr(step), norm))

    for (loss, lr, norm), (want_loss, want_lr, want_norm) in zip(
        got["results"], expected, strict=True
    ):
        assert loss == pytest.approx(want_loss, rel=1e-9)
        assert lr == pytest.approx(want_lr, rel=1e-12)
        assert norm == pytest.approx(want_norm, rel=1e-9)
    want = model.state_dict()
    for state in got["states"]:  # every replica
        assert sorted(state) == sorted(want)
        for name, value in want.items():
            torch.testing.assert_close(state[name], value, rtol=1e-9, atol=1e-12, msg=name)


# ------------------------------------------------------------------------- the schedule


def optimizer(decay: str, warmup: int = 4) -> Optimizer:
    return Optimizer(
        name="sgd",
        lr=0.1,
        momentum=0.0,
        weight_decay=0.0,
        schedule=Schedule(warmup_steps=warmup, decay=decay, min_lr=0.01),
    )


@pytest.mark.parametrize(
    ("decay", "step", "lr"),
    [
        ("cosine", 0, 0.025),
        ("cosine", 3, 0.1),  # warmup: lr * (step + 1) / 4
        ("cosine", 4, 0.1),  # the decay's start: progress 0 of 10 steps
        ("cosine", 6, 0.01 + 0.09 * 0.5 * (1 + math.cos(0.2 * math.pi))),  # progress 0.2
        ("cosine", 9, 0.055),
        ("linear", 9, 0.055),  # half way: the mean of lr and minLr
        ("linear", 6, 0.01 + 0.09 * 0.8),
        ("linear", 13, 0.01 + 0.09 * 0.1),
        ("constant", 2, 0.075),
        ("constant", 13, 0.1),
    ],
)
def test_the_learning_rate_at_chosen_steps_is_the_formula(decay: str, step: int, lr: float):
    assert learning_rate(optimizer(decay), 14, step) == pytest.approx(lr, rel=1e-12)


def test_without_a_schedule_or_warmup_the_lr_is_as_written():
    plain = Optimizer(name="sgd", lr=0.1, momentum=0.0, weight_decay=0.0)
    assert [learning_rate(plain, 5, s) for s in range(5)] == [0.1] * 5
    assert learning_rate(optimizer("cosine", warmup=0), 10, 0) == 0.1  # no warmup: starts at lr


# ------------------------------------------------------------------------- validation


def refusals(**fields: Any) -> list[str]:
    with pytest.raises(spec.InvalidSpec) as refused:
        spec.parse(pipeline_job("bad", **fields))
    return [str(e) for e in refused.value.errors]


def test_bad_recipes_are_refused_with_field_paths():
    schedule = {"warmupSteps": 20, "decay": "cosine", "minLr": 0.001}
    assert refusals(steps=10, optimizer={"lr": 0.01, "schedule": schedule}) == [
        "spec.optimizer.schedule.warmupSteps: optimizer.schedule.warmupSteps must be at most"
        " spec.steps (warmup is part of the run)"
    ]
    schedule = {"warmupSteps": 2, "decay": "cosine", "minLr": 0.1}
    assert refusals(optimizer={"lr": 0.01, "schedule": schedule}) == [
        "spec.optimizer.schedule.minLr: schedule.minLr must be at most lr (the decay goes down"
        " from lr to minLr)"
    ]
    (fp16,) = refusals(precision="fp16")
    assert fp16.startswith("spec.precision: fp16 needs GPUs") and "CPU job" in fp16
    assert refusals(optimizer={"clipGradNorm": 0}) == [
        "spec.optimizer.clipGradNorm: must be > 0, got 0.0"
    ]
    assert refusals(gradientAccumulation=0) == ["spec.gradientAccumulation: must be >= 1, got 0"]
    (decay,) = refusals(optimizer={"schedule": {"decay": "step"}})
    assert decay.startswith("spec.optimizer.schedule.decay: must be one of constant, linear")
    assert refusals(precision="fp8")[0].startswith("spec.precision: must be one of fp32, bf16")
    # What is allowed: fp16 with a GPU, warmup as long as the run, minLr equal to lr.
    ok = {"warmupSteps": 10, "decay": "linear", "minLr": 0.01}
    spec.parse(
        pipeline_job(
            "ok", steps=10, precision="fp16", gpusPerStage=1, optimizer={"lr": 0.01, "schedule": ok}
        )
    )


# ------------------------------------------- resume mid-warmup and mid-decay, TensorBoard


def scalars(directory: Path) -> dict[str, dict[int, list[float]]]:
    """Every scalar of the event files under `directory`, read back by TensorBoard's own
    reader (purging what a resumed run overwrote, as TensorBoard shows it): {tag: {step:
    [values]}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0}).Reload()
    out: dict[str, dict[int, list[float]]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            out.setdefault(tag, {}).setdefault(event.step, []).append(event.value)
    return out


# slow: two worlds: the schedule's values in process above, test_checkpoint.py's exact resume, the
# hybrid job's TensorBoard events
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resumes_mid_warmup_and_mid_decay_exactly_and_tensorboard_reads_every_step(tmp_path):
    """Checkpoints every 2 steps of 10, warmup 3, cosine decay. A run that cannot write its
    checkpoint of step 4 (a file stands where its directory goes) fails after that of step
    2; the next resumes mid-warmup and fails at step 8; the third resumes mid-decay (from 6)
    and ends. Their losses, learning rates and gradient norms are the uninterrupted run's,
    and TensorBoard reads one value per step of each, equal to the run's summary."""
    fields = {
        "stages": 2,
        "steps": 10,
        "microBatches": 2,
        "splitPoints": ["layer3.0"],
        "preflight": {"enabled": False},
        "logEvery": 5,
        "optimizer": {
            "name": "adamw",
            "lr": 0.003,
            "clipGradNorm": 1.0,
            "schedule": {"warmupSteps": 3, "decay": "cosine", "minLr": 0.0003},
        },
    }

    def job(name: str) -> dict[str, Any]:
        root = tmp_path / name
        return pipeline_job(
            name,
            **fields,
            checkpoint={"path": str(root / "ck"), "everySteps": 2},
            logging={"tensorboard": str(root / "tb")},
        )

    code, out, whole = run_to_end(job("whole"), tmp_path, timeout=150)
    assert code == 0, out
    assert whole["learningRates"] == pytest.approx([learning_rate_of(s) for s in range(10)])
    assert "lr 0.00" in out and "grad norm " in out

    ck = tmp_path / "part" / "ck"
    ck.mkdir(parents=True)
    resumed = {}
    for blocked, resumes in ((4, None), (8, 2), (None, 6)):
        for old in ck.glob("step-*"):
            if old.is_file():
                old.unlink()
        if blocked is not None:
            checkpoint.step_dir(ck, blocked).write_text("in the way")
        code, out, summary = run_to_end(job("part"), tmp_path, timeout=150)
        assert code == (0 if blocked is None else 1), out
        if resumes is not None:
            assert f"resumed from step {resumes} " in out, out
            resumed[resumes] = out
            got = summary if blocked is None else None
    assert got is not None and got["resumedFromStep"] == 6
    # The last run: steps 7..10, mid-decay, exactly as the uninterrupted run trained them.
    for key in ("losses", "learningRates", "gradNorms"):
        assert got[key] == pytest.approx(whole[key][6:], rel=1e-5, abs=1e-7), key

    # TensorBoard's reader: one value per step in both runs' event files (the resumed runs
    # replaced what the failed ones wrote after their checkpoint), equal to the summaries.
    for name, summary, first in (("whole", whole, 0), ("part", got, 6)):
        board = scalars(tmp_path / name / "tb")
        for tag, key in (
            ("train/loss", "losses"),
            ("train/learning_rate", "learningRates"),
            ("train/grad_norm", "gradNorms"),
        ):
            assert sorted(board[tag]) == list(range(1, 11)), (name, tag)
            assert all(len(v) == 1 for v in board[tag].values()), (name, tag, board[tag])
            values = [board[tag][s][0] for s in range(first + 1, 11)]
            assert values == pytest.approx(summary[key], rel=1e-6), (name, tag)  # float32
        assert set(board["train/samples_per_second"]) == set(range(1, 11))
        assert set(board["train/bubble"]) == {5, 10}  # measured at logEvery's steps


def learning_rate_of(step: int) -> float:
    """The schedule of the resume test: warmup 3 from 0.003, cosine to 0.0003 over 7 steps."""
    if step < 3:
        return 0.003 * (step + 1) / 3
    return 0.0003 + (0.003 - 0.0003) * 0.5 * (1 + math.cos(math.pi * (step - 3) / 7))


@pytest.mark.timeout(200)
def test_a_hybrid_job_writes_tensorboard_events_and_refuses_what_it_lacks(tmp_path: Path):
    """A HybridJob's master writes the mean loss and samples/s of each logged step (its
    lines, to their 4 printed decimals); schedule and clipping it refuses by name."""
    from test_hybrid import TINY

    manifest = TINY | {"spec": TINY["spec"] | {"logging": {"tensorboard": str(tmp_path / "tb")}}}
    code, out, summary = run_to_end(manifest, tmp_path, timeout=170)
    assert code == 0, out
    board = scalars(tmp_path / "tb")
    printed = {int(m[1]): float(m[2]) for m in re.finditer(r"step (\d+)/40 +loss ([\d.]+)", out)}
    assert sorted(printed) == [10, 20, 30, 40]
    assert {s: v[0] for s, v in board["train/loss"].items()} == pytest.approx(printed, abs=6e-5)
    assert sorted(board["train/samples_per_second"]) == [10, 20, 30, 40]

    for extra in ({"clipGradNorm": 1.0}, {"schedule": {"warmupSteps": 2}}):
        bad = TINY["spec"] | {"optimizer": TINY["spec"]["optimizer"] | extra}
        with pytest.raises(spec.InvalidSpec, match=r"spec\.optimizer: a HybridJob has no"):
            spec.parse(TINY | {"spec": bad})
