"""Mixed precision and activation checkpointing of a PipelineJob's stages (issue 21), on
pipejob's own transformer language model: one step's gradients through a real pipeline
world against plain float32 autograd in one process, and a stage's peak memory with and
without checkpointing."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn
from userdata import BYTE_VOCAB, write_stdlib_tokens
from userpkg.fp16_mlp import mlp32

from jobrun import (
    _stage_gradients,
    check_gradients,
    master_of,
    pipeline_job,
    run_to_end,
    run_world,
)
from pipejob.core import plan, spec
from pipejob.core.workload import Transformer
from pipejob.runner.local import LOOPBACK, free_ports
from pipejob.trainer import workloads
from pipejob.trainer.pipeline.cut_model import CutModel, Partition, plan_cut
from pipejob.trainer.pipeline.rpc.driver import RpcPipeline, RpcReplicas, forward_backward
from pipejob.trainer.pipeline.rpc.stage import RpcStage
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.runtime import memory
from pipejob.trainer.workloads import cut, data, models
from pipejob.trainer.workloads.transformer import TransformerLM

pytestmark = pytest.mark.timeout(240)

TRANSFORMER = {"vocabSize": BYTE_VOCAB, "layers": 3, "width": 64, "heads": 4, "seqLen": 64}


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stdlib-bytes")
    train = root / "train.bin"
    write_stdlib_tokens(train, max_bytes=100_000)
    return {"train": str(train)}


def lm_job(text: dict[str, str], **fields: Any) -> spec.Job:
    return spec.parse(
        pipeline_job(
            "lm",
            **{
                "model": {"transformer": TRANSFORMER},
                "data": {"tokens": text, "workers": 1},
                "batchSize": 8,
                "microBatches": 2,
                "stages": 2,
                "steps": 1,
                **fields,
            },
        )
    )


@pytest.mark.slow  # the pipelining engine's test below holds the same gradients
def test_activation_checkpointing_gives_the_same_gradients(text, tmp_path: Path):
    """Recomputing each stage's forward in the backward (inside the distributed autograd
    engine) gives the gradients of plain autograd in one process."""
    check_gradients(lm_job(text, activationCheckpointing=True, engine="rpc"), tmp_path)


def test_activation_checkpointing_on_the_pipelining_engine_gives_the_same_gradients(
    text, tmp_path: Path
):
    """The same on the pipelining engine, where torch's schedules run the backward: 1F1B,
    and zero-bubble, which splits each backward into the inputs' and the weights' gradients
    over the recomputed graph."""
    job = lm_job(text, activationCheckpointing=True, engine="pipelining")
    check_gradients(
        job,
        tmp_path,
        schedules=[
            {"schedule": "1f1b", "stages_per_process": 1},
            {"schedule": "zero-bubble", "stages_per_process": 2},
        ],
    )


def _bf16_world(rank: int, envs: list[dict[str, str]], out: str) -> None:
    """A real pipeline world in float32 (the dtype bf16 autocasts from): the master runs one
    step through stages that compute in the job's precision and saves every gradient."""
    if (env := master_of(rank, envs)) is None:
        return
    try:
        s = env.spec
        with data.Feed(s) as feed:
            batch = feed.batch()
        cut_model = plan_cut(s, *models.build_meta(s), env.names("stage"))
        pipe = RpcPipeline(env.names("stage"), cut_model, "cpu", s.precision)
        with dist_autograd.context() as context_id:
            loss, _ = forward_backward(
                pipe, pipe.read(s.micro_batches, batch), 0, context_id, workloads.loss(s)
            )
            grads: dict[str, torch.Tensor] = {}
            for stage in pipe.stages:
                grads |= rpc.rpc_sync(stage.name, _stage_gradients, args=(stage, context_id))
        torch.save({"loss": loss.item(), "grads": grads}, out)
    finally:
        rpc.shutdown()


def test_bf16_gradients_are_float32_ones_to_bf16_precision(text, tmp_path: Path):
    """bf16 autocast keeps 8 bits of mantissa (rounding 2^-9 = 0.2% per operation); through
    the 3 blocks, the loss and its gradients the whole gradient of a parameter stays within
    a few percent of float32's (relative L2; measured here: at most 0.4%). 5% leaves room for
    other kernels, while a gradient lost or doubled (a wrong cast, an unscaled loss) is off by
    50% or more."""
    job = lm_job(text, precision="bf16", engine="rpc")  # its world drives the RpcPipeline
    rpc_port, ddp_port = free_ports(2)
    processes = plan.plan_world(job, lambda m: LOOPBACK, plan.Ports(rpc_port, ddp_port))
    got = run_world(_bf16_world, [p.env for p in processes], tmp_path / "bf16.pt")

    s = job.settings
    model = models.build(s)
    with data.Feed(s) as feed:
        inputs, labels = feed.batch()
    loss = workloads.loss(s)(model(inputs), labels)
    loss.backward()
    assert got["loss"] == pytest.approx(loss.item(), rel=0.01)
    errors = {}
    for name, p in model.named_parameters():
        grad = got["grads"][name]
        assert grad is not None and grad.dtype == torch.float32, name  # float32 weights
        errors[name] = ((grad - p.grad).norm() / p.grad.norm()).item()
    print(f"bf16 gradients against float32: largest relative error {max(errors.values()):.4f}")
    assert 0 < max(errors.values()) < 0.05, errors  # 0: bf16 did not compute at all


def test_bf16_on_cpu_and_fp16_only_with_gpus_are_what_validation_allows(text):
    assert lm_job(text, precision="bf16").settings.precision == "bf16"
    with pytest.raises(spec.InvalidSpec, match=r"spec\.precision: fp16 needs GPUs"):
        lm_job(text, precision="fp16")


@pytest.mark.slow  # two runs of 40 steps; bf16's gradients are proven in one step above
def test_bf16_trains_the_language_model_as_far_as_float32(text, tmp_path: Path):
    """The same 40 steps in float32 and in bf16: the mean loss of the last 10 steps agrees
    within 0.05 nats (2% of the loss there; the examples' 200 steps, measured: final
    held-out loss 2.5020 float32, 2.5019 bf16). A bf16 that does not learn stays near
    ln 256 = 5.5."""
    means = {}
    for precision in ("fp32", "bf16"):
        job = pipeline_job(
            f"lm-{precision}",
            **{
                "model": {"transformer": TRANSFORMER},
                "data": {"tokens": text, "workers": 1},
                "batchSize": 16,
                "microBatches": 4,
                "stages": 2,
                "steps": 40,
                "logEvery": 20,
                "precision": precision,
                "preflight": {"enabled": False},
                "optimizer": {"name": "adamw", "lr": 0.003, "clipGradNorm": 1.0},
            },
        )
        code, out, summary = run_to_end(job, tmp_path, timeout=150)
        assert code == 0, out
        assert summary["precision"] == precision
        means[precision] = sum(summary["losses"][-10:]) / 10
    print(f"mean loss of steps 31..40: {means}")
    assert means["fp32"] < 5.5 - 1.5, means  # it learns at all
    assert abs(means["bf16"] - means["fp32"]) < 0.05, means


# ------------------------------------------------------------------- peak memory


def _peak_megabytes(recompute: bool) -> float:
    """In a fresh process: how far a stage of 4 blocks (width 256) raises the process's peak
    resident memory in a GPipe step of 4 micro-batches of 4 windows of 256 tokens: every
    forward, then every backward, as the stages run them."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    spec_ = Transformer(vocab_size=256, layers=4, width=256, heads=4, seq_len=256)
    blocks = nn.Sequential(*TransformerLM(spec_).blocks)
    stage = RpcStage(blocks, last=False, device="cpu", recompute=recompute)
    warm = torch.randn(1, 256, 256, requires_grad=True)  # one-time allocations: not counted
    stage.compute(warm).sum().backward()
    inputs = [torch.randn(4, 256, 256, requires_grad=True) for _ in range(4)]
    # The peak from here on, so that whatever the process held before (imports, the warm-up)
    # does not hide the step's own peak.
    memory.reset_peak()
    before = memory.status_kb("VmRSS")
    outputs = [stage.compute(x) for x in inputs]
    for y in outputs:
        y.backward(torch.ones_like(y))
    return (memory.status_kb("VmHWM") - before) / 1024


@pytest.mark.slow  # the pipelining engine's recomputation gives the same gradients above
def test_activation_checkpointing_lowers_a_stages_peak_memory():
    """Peak resident memory is a count of bytes, not a time. Without checkpointing a stage
    keeps every micro-batch's activations from its forward to its backward; with it, only
    each micro-batch's input, and one micro-batch's activations while they are recomputed
    (a quarter of the activations here, plus the inputs and the gradients). Measured: 294 MB
    plain, 127 MB checkpointed."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1, maxtasksperchild=1) as pool:
        plain = pool.apply(_peak_megabytes, (False,))
    with context.Pool(1, maxtasksperchild=1) as pool:
        recomputed = pool.apply(_peak_megabytes, (True,))
    print(
        f"peak memory of a forward and backward: {plain:.0f} MB plain,"
        f" {recomputed:.0f} MB with activation checkpointing"
    )
    assert recomputed < 0.6 * plain, (plain, recomputed)


# ------------------------------------------------------------------- fp16's loss scale


def _fp16_world(rank: int, envs: list[dict[str, str]], out: str) -> None:
    """fp16 is for GPUs and validation refuses it on CPU; torch's CPU autocast computes fp16
    too, so this world runs the trainer's fp16 path (autocast, loss scale, unscaling,
    skipping an overflowed step) on CPU: a step whose scaled loss overflows, then one that
    does not."""
    if (env := master_of(rank, envs)) is None:
        return
    try:
        s = dataclasses.replace(env.spec, precision="fp16")
        traced = cut.Traced(mlp32())
        cut_model = CutModel(
            traced.units,
            traced.split(["fc2"]),
            Partition([range(0, 2), range(2, 5)], [1.0] * 5, 2),
            {},
        )
        replicas = RpcReplicas([env.names("stage")], cut_model, s)
        before = {
            k: v
            for part in replicas.pipelines[0].stage_results(StageBase.state)
            for k, v in part.items()
        }
        (x1, y1), (x2, y2) = fp16_batches()
        replicas.loss_scale.scale = 2.0**200  # the scaled loss is inf in float32
        first = replicas.step(2, 0, F.cross_entropy, (x1, y1))
        overflowed = replicas.loss_scale.scale
        skipped = {
            k: v
            for part in replicas.pipelines[0].stage_results(StageBase.state)
            for k, v in part.items()
        }
        replicas.loss_scale.scale = 2.0**16  # torch's GradScaler's start: no overflow
        second = replicas.step(2, 1, F.cross_entropy, (x2, y2))
        after = {
            k: v
            for part in replicas.pipelines[0].stage_results(StageBase.state)
            for k, v in part.items()
        }
        torch.save(
            {
                "first": first.grad_norm,
                "overflowed": overflowed,
                "before": before,
                "skipped": skipped,
                "second": (second.loss, second.grad_norm),
                "scale": replicas.loss_scale.scale,
                "after": after,
            },
            out,
        )
    finally:
        rpc.shutdown()


def fp16_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(16, 5, generator=g), torch.randint(3, (16,), generator=g)) for _ in range(2)
    ]


def test_fp16_loss_scaling_skips_an_overflow_and_unscales_the_gradients(tmp_path: Path):
    """The overflowed step changes no parameter and halves the scale; the next step's
    gradients, unscaled, are float32's to fp16 precision (10 bits of mantissa: 0.05% per
    operation, a 2% bound on the norm and the parameters' change), at the same scale."""
    job = spec.parse(
        pipeline_job(  # its world drives the rpc engine's RpcReplicas
            "fp16", engine="rpc", stages=2, microBatches=2, optimizer={"name": "sgd", "lr": 0.5}
        )
    )
    ports = free_ports(4 + 2)
    processes = plan.plan_world(job, lambda m: LOOPBACK, plan.Ports(*ports[:4], groups=()))
    got = run_world(_fp16_world, [p.env for p in processes], tmp_path / "fp16.pt")

    assert not math.isfinite(got["first"]) and got["overflowed"] == 2.0**199
    for name, value in got["before"].items():
        assert torch.equal(got["skipped"][name], value), f"{name} changed in a skipped step"

    assert_the_second_step_follows_float32s(got, *got["second"])


def assert_the_second_step_follows_float32s(got: dict, loss: float, norm: float) -> None:
    """An fp16 world's second step (loss, norm, the parameters it moved by, the loss scale)
    against float32's step of `mlp32` on the same batch, SGD at lr 0.5."""
    model = mlp32()
    (_, _), (x, y) = fp16_batches()
    expected_loss = F.cross_entropy(model(x), y)
    expected_loss.backward()
    expected_norm = nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    assert loss == pytest.approx(expected_loss.item(), rel=0.01)
    assert norm == pytest.approx(expected_norm, rel=0.02)
    assert got["scale"] == 2.0**16  # one good step: no growth before 2000 of them
    for name, p in model.named_parameters():
        moved = got["after"][name] - got["before"][name]
        expected = -0.5 * p.grad
        error = ((moved - expected).norm() / expected.norm()).item()
        assert error < 0.02, f"{name}: fp16 step off by {error:.4f} of float32's"
