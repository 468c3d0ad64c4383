"""Pipeline replicas (PipelineJob.spec.replicas): R copies of the pipeline on R shares of each
batch, stage i of every replica averaging its gradients with the others', compute what one
pipeline computes on the whole batch; they stay identical, checkpoint once and resume."""

from __future__ import annotations

import os
import re
import signal
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn

from jobrun import TOLERANCE, JobRun, master_of, pipeline_job, run_world
from pipejob.core import plan, spec
from pipejob.runner.local import LOOPBACK, free_ports
from pipejob.trainer.pipeline.cut_model import CutModel, Partition
from pipejob.trainer.pipeline.rpc.driver import RpcReplicas
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.runtime import checkpoint
from pipejob.trainer.workloads import cut

# SGD with momentum and weight decay: the optimizer state must agree too. ResNet-18's
# BatchNorm normalises each micro-batch by its own statistics, so both runs use micro-batches
# of the same size (8): their parameters agree, their running statistics do not (the single
# pipeline folds in twice as many micro-batches per step). No Dropout: its masks are drawn per
# process. The runs add the same gradients in another order (the all-reduce averages what one
# backward sums), and BatchNorm's gradients at initialisation amplify that rounding: in
# float32 the parameters after step 1 differed by 1.5e-8 on one machine and 1.7e-6 on another
# (other kernels), and by up to 6.5e-4 after step 2. The check is about the algorithm, not
# float32's rounding, so the union test trains in float64 (tests/userpkg/exact.py), where the
# same reordering leaves about 1e-12 of the magnitudes involved on any machine.
COMMON = {
    "stages": 2,
    "steps": 2,
    "seed": 4,
    "imageSize": 64,
    "preflight": {"megabytes": 0.5},
    "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weightDecay": 0.001},
}
REPLICATED = COMMON | {"replicas": 2, "batchSize": 16, "microBatches": 2}
ONE_PIPELINE = COMMON | {"replicas": 1, "batchSize": 32, "microBatches": 4}  # their union
FLOAT64 = {
    "model": {"import": "userpkg.exact:resnet18", "args": {"classes": 10}},
    "data": {"import": "userpkg.exact:images", "args": {"image_size": 64}},
}
EXACT_AFTER_STEP = 1


BATCH_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def checkpointed(name: str, fields: dict[str, Any], path: Path, every: int) -> dict[str, Any]:
    return pipeline_job(name, **fields, checkpoint={"path": str(path), "everySteps": every})


def parameters(root: Path, step: int) -> dict[str, torch.Tensor]:
    """The trained parameters and optimizer state of the checkpoint of `step`, by parameter
    name whichever stage holds them (each run measures its own cut)."""
    found = checkpoint.verify(checkpoint.step_dir(root, step))
    assert isinstance(found, checkpoint.Checkpoint), found
    names = sorted(e["name"] for e in found.manifest["files"] if e["name"].startswith("stage"))
    assert names == ["stage0.pt", "stage1.pt"]  # one copy of each stage, whatever the replicas
    out: dict[str, torch.Tensor] = {}
    for name in names:
        part = found.load(name)
        out |= {k: v for k, v in part["model"].items() if not k.endswith(BATCH_STATISTICS)}
        for param, state in part["optimizers"]["optimizer"].items():
            out |= {f"{param}#{key}": value for key, value in state.items()}
    return out


@pytest.mark.slow  # two worlds: the replicas' step against one process's below holds the equality
@pytest.mark.timeout(400)
def test_two_replicas_equal_one_pipeline_on_their_union(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # userpkg for the processes
    replicated = checkpointed("replicated", REPLICATED | FLOAT64, tmp_path / "two", every=1)
    with JobRun(replicated, tmp_path, "two") as run:
        assert run.finish(180) == 0, run.output
        output, summary = run.output, run.summary()
    for r in (0, 1):
        for i in (0, 1):
            assert re.search(rf"^pipejob: started r{r}-stage{i} ", output, re.M), output
    assert summary["replicas"] == 2
    assert summary["replicaDivergence"] == 0.0  # the replicas hold identical parameters
    assert summary["allreduceSecondsPerStep"] > 0

    single = checkpointed("single", ONE_PIPELINE | FLOAT64, tmp_path / "one", every=1)
    with JobRun(single, tmp_path, "one") as run:
        assert run.finish(180) == 0, run.output
        expected_losses = run.summary()["losses"]

    # The same losses (the mean over the whole batch) ...
    assert summary["losses"] == pytest.approx(expected_losses, rel=TOLERANCE)
    # ... and the same momentum buffers and parameters after step 1, up to float rounding.
    got = parameters(tmp_path / "two", EXACT_AFTER_STEP)
    expected = parameters(tmp_path / "one", EXACT_AFTER_STEP)
    assert sorted(got) == sorted(expected)
    assert_first_sgd_step_equal(got, expected, COMMON["optimizer"]["lr"])


def assert_first_sgd_step_equal(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], lr: float
) -> None:
    """Both runs start from the same seeded float64 parameters p0, and after SGD's first step
    each momentum buffer is the gradient plus weight decay (b = g + wd * p0) and each
    parameter is p0 - lr * b. Summed in another order, a gradient may differ by some eps
    of its scale times the amplification of the backward: float32 showed up to ~2,000 (a
    difference of 2.3e-4 of conv1's scale), so 1e6 eps (2.2e-10 of the scale) leaves a wide
    margin on any machine and still catches an error in the averaging. The parameters must
    then differ by exactly lr times the buffers' difference, up to the rounding of
    p0 - lr * b in each run: eps relative to the magnitudes involved."""
    eps = torch.finfo(torch.float64).eps
    for name in (k for k in expected if "#" not in k):
        buffer = f"{name}#momentum_buffer"
        assert got[name].dtype == expected[name].dtype == torch.float64, name
        off = (got[buffer] - expected[buffer]).abs().max().item()
        scale = expected[buffer].abs().max().item()
        assert off <= 1e6 * eps * scale, f"{buffer} after step 1: off by {off:.3g} of {scale:.3g}"
        explained = (got[name] - expected[name]) + lr * (got[buffer] - expected[buffer])
        rounding = 2 * eps * (expected[name].abs() + lr * expected[buffer].abs())
        worst = (explained.abs() - rounding).max().item()
        assert worst <= 0, f"{name} after step 1: off by {worst:.3g} beyond float64 rounding"


# slow: test_operator_e2e.py's pipelining replicas resume from the one copy after a kill
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_stage_of_replica_1_resumes_from_the_one_copy(tmp_path: Path) -> None:
    # the rpc engine's replicas (test_operator_e2e.py: the pipelining engine's)
    fields = REPLICATED | {"engine": "rpc", "steps": 6, "imageSize": 32, "batchSize": 8}
    manifest = checkpointed("rep-resume", fields, tmp_path / "ck", every=2)
    with JobRun(manifest, tmp_path, "broken") as run:
        run.wait_for(r"^master\s*\| step 3/6 ", timeout=200)
        os.kill(run.pid("r1-stage0"), signal.SIGKILL)
        assert run.finish(60) != 0, run.output
        assert "r1-stage0 (role stage, rank 3) failed: killed by signal SIGKILL" in run.output
    newest = checkpoint.latest(tmp_path / "ck")
    assert newest is not None and newest.step >= 2

    with JobRun(manifest, tmp_path, "again") as run:  # the restarted world
        assert run.finish(200) == 0, run.output
        output, summary = run.output, run.summary()
    assert re.search(rf"^master\s*\| resumed from step {newest.step} \(", output, re.M), output
    assert summary["resumedFromStep"] == newest.step
    assert summary["replicaDivergence"] == 0.0  # every replica loaded the same copy


# ------------------------------------------------------- exact, with a model made for it

EXACT_STEPS, SHARE = 4, 6  # steps; samples per replica per step


def mlp() -> nn.Sequential:
    """No batch statistics, no Dropout: every sample's gradient is its own, so the replicas
    and one process must agree step after step, up to rounding (in float64: the check is
    about the algorithm)."""
    torch.manual_seed(7)
    return nn.Sequential(
        OrderedDict(
            [
                ("fc1", nn.Linear(5, 16)),
                ("act1", nn.Tanh()),
                ("fc2", nn.Linear(16, 16)),
                ("act2", nn.Tanh()),
                ("fc3", nn.Linear(16, 3)),
            ]
        )
    ).double()


def batches(replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    n = SHARE * replicas
    return [
        (torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(3, (n,), generator=g))
        for _ in range(EXACT_STEPS)
    ]


def _replica_world(rank: int, envs: list[dict[str, str]], out: str) -> None:
    """One process of a real replicated world: stages run the trainer's own stage role (they
    join their group and serve); the master drives the trainer's RpcReplicas over the MLP."""
    if (env := master_of(rank, envs)) is None:
        return
    try:
        s = env.spec
        names = env.names("stage")
        per_replica = [names[r * s.stages : (r + 1) * s.stages] for r in range(s.replicas.max)]
        traced = cut.Traced(mlp())
        cut_model = CutModel(
            traced.units,
            traced.split(["fc2"]),
            Partition([range(0, 2), range(2, 5)], [1.0] * 5, 2),
            {},
        )
        replicas = RpcReplicas(per_replica, cut_model, s)
        losses = [
            replicas.step(2, step, F.cross_entropy, batch).loss
            for step, batch in enumerate(batches(s.replicas.max))
        ]
        states = [
            {k: v for part in p.stage_results(StageBase.state) for k, v in part.items()}
            for p in replicas.pipelines
        ]
        torch.save({"losses": losses, "states": states}, out)
    finally:
        rpc.shutdown()


@pytest.mark.timeout(200)
def test_replicas_train_exactly_what_one_process_trains_on_their_union(tmp_path: Path) -> None:
    job = spec.parse(
        pipeline_job(  # the rpc engine's replicas: its RpcReplicas, stage i's dp group
            "exact",
            engine="rpc",
            stages=2,
            replicas=2,
            microBatches=2,
            optimizer=COMMON["optimizer"],
        )
    )
    ports = free_ports(4 + 2)  # and one for each stage's group
    world_ports = plan.Ports(*ports[:4], groups=tuple(ports[4:]))
    processes = plan.plan_world(job, lambda m: LOOPBACK, world_ports)
    got = run_world(_replica_world, [p.env for p in processes], tmp_path / "replicas.pt")

    # The reference: plain autograd on the whole batch, one optimizer, one process.
    model = mlp()  # the stages keep its names: fc1.weight, ...
    opt = COMMON["optimizer"]
    optimizer = torch.optim.SGD(
        model.parameters(), lr=opt["lr"], momentum=opt["momentum"], weight_decay=opt["weightDecay"]
    )
    losses = []
    for x, y in batches(2):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # Four steps of the same sums in another order: float64's rounding, amplified a little by
    # each step, stays far below TOLERANCE of the magnitudes involved (jobrun.TOLERANCE).
    assert got["losses"] == pytest.approx(losses, rel=TOLERANCE)
    expected = model.state_dict()
    for state in got["states"]:  # every replica
        assert sorted(state) == sorted(expected)
        for name, value in expected.items():
            scale = value.abs().max().item()
            torch.testing.assert_close(
                state[name], value, rtol=TOLERANCE, atol=TOLERANCE * scale, msg=name
            )
    assert all(torch.equal(got["states"][0][k], got["states"][1][k]) for k in expected)
