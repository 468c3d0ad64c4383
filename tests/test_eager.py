"""The eager path (trainer/pipejob/trainer/pipeline/eager/): the master runs the model's own
forward and calls its costly modules where they live on the stages. In process: the
placement, its one-process check, the stages' micro-batch order, a stage's precision,
recomputation and moving average, what a non-finite step names, the spec's refusal; a module
under two names, forwards one at a time where a kept module writes state the glue reads, a
tensor subclass to a stage and back (the last two in an RPC world of this process alone). Two
worlds: an ESM-2-like encoder the trace refuses takes the eager path by itself, and 2
replicas x 2 accumulated batches with activation checkpointing; each one's first step
equals one process's in float64 (loss and every parameter after one SGD step). Slow: a
resume to the bit, two runs with replicas to the bit, bf16 against one process under
autocast, a checkpoint resumed on another stage and replica count, a non-finite step
skipped, spec.ema against one process, early stopping with the best step's weights out."""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from test_precision import assert_the_second_step_follows_float32s, fp16_batches
from torch import nn
from userpkg import esmlike, skip_heads, traced_cases

from jobrun import JobRun, assert_fits, master_of, pipeline_job, run_to_end, run_world
from pipejob.core import plan, spec
from pipejob.runner.local import LOOPBACK, free_ports
from pipejob.trainer import workloads
from pipejob.trainer.pipeline.eager import remote
from pipejob.trainer.pipeline.eager import run as eager_run
from pipejob.trainer.pipeline.eager import saved as eager_saved
from pipejob.trainer.pipeline.eager.check import check
from pipejob.trainer.pipeline.eager.held import Held
from pipejob.trainer.pipeline.eager.one_step import Stages, computed, not_finite, step
from pipejob.trainer.pipeline.eager.placement import (
    aliases,
    no_grad_run,
    place,
    replace,
    under_every_name,
)
from pipejob.trainer.pipeline.eager.turns import Turns
from pipejob.trainer.pipeline.gradients import LossScale
from pipejob.trainer.pipeline.stage_base import float32
from pipejob.trainer.runtime import checkpoint, model_files, nonfinite
from pipejob.trainer.workloads import data, models

TESTS = Path(__file__).parent


def _tokens() -> torch.Tensor:
    return torch.stack([esmlike.sequences("train")[i][0] for i in range(4)])


def test_placement_follows_the_forward_and_keeps_the_models_names():
    """ESM's layers sit in a ModuleList the forward never calls itself: it opens into them;
    the stages get contiguous runs in the order the forward calls them."""
    torch.manual_seed(0)
    model = esmlike.esm2()
    placement = place(model, no_grad_run(model, _tokens()), 2)
    assert placement.remote() == [
        "embed_tokens",
        "layers.0",
        "layers.1",
        "layers.2",
        "layers.3",
        "emb_layer_norm_after",
        "head",
    ]
    assert all(placement.stages) and placement.kept == {}


class DeepSupervised(nn.Module):
    """As MONAI's DynUNet: a layer writes a head's output into a list made when the model
    was (so it holds the last batch's head, not this one's, where the layer runs elsewhere)
    and that the forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.heads: list[torch.Tensor] = [torch.zeros(1)]
        self.down = Writes(self.heads)
        self.mid = nn.Linear(4, 4)
        self.up = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.up(self.mid(self.down(x)))
        return self.out(x + self.heads[0])


class Writes(nn.Module):
    def __init__(self, heads: list[torch.Tensor]) -> None:
        super().__init__()
        self.heads = heads
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.heads[0] = y * 2
        return y


def test_a_module_writing_state_the_glue_reads_stays_with_the_glue():
    model = DeepSupervised()
    run, other = no_grad_run(model, torch.randn(3, 4)), no_grad_run(model, torch.randn(3, 4))
    placement = check(model, run, lambda kept: place(model, run, 2, kept), other)
    assert "down" in placement.kept and "Python state" in placement.kept["down"]
    assert "down" not in placement.remote() and all(placement.stages)


def test_a_stage_computes_a_modules_micro_batches_in_order():
    """Micro-batch 1's call waits for micro-batch 0's, or for its forward's end without it."""
    turns, order = Turns(), []

    def call(number: int) -> None:
        turns.wait(("layer", 0), 10, number, timeout=10)
        order.append(number)
        turns.made(("layer", 0), number)

    later = threading.Thread(target=call, args=(12,))
    later.start()
    later.join(0.2)
    assert later.is_alive()  # 10 and 11 have not called yet
    call(10)
    turns.ended(11)  # 11's forward ended without calling the layer
    later.join(10)
    assert order == [10, 12]


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, the first and last modules."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.embed(tokens)))


def test_a_weight_used_in_two_places_lives_in_one():
    model = Tied()
    placement = place(model, no_grad_run(model, torch.randint(16, (2, 5))), 2)
    where = placement.stage_of()
    assert where["out"] == where["embed"] == 0
    assert len(placement.stages) == 2 and all(placement.stages)


def test_a_module_registered_under_two_names_is_one_module_with_one_gradient(monkeypatch):
    """DynUNet's stand-in: input_block is also skip_layers.downsample. Placed on a stage, it
    is called there under both names, and the one-process check (benchmarks/
    _conform_eager.py) finds its gradient, under both names, equal to the plain model's."""
    monkeypatch.syspath_prepend(str(TESTS.parent / "benchmarks"))
    import _conform_eager

    stages = _conform_eager.check_eager(skip_heads.skip_heads, torch.randn(8, 4))
    # Placed by measured cost, so what joins it on its stage varies with the machine's load.
    assert stages.split(" | ")[0].split(", ")[0] == "input_block", stages
    model = skip_heads.skip_heads()
    assert aliases(model, "input_block") == ["input_block", "skip_layers.downsample"]
    run, other = no_grad_run(model, torch.randn(4, 4)), no_grad_run(model, torch.randn(4, 4))
    placement = check(model, run, lambda kept: place(model, run, 2, kept), other)
    assert placement.also["input_block"] == ["skip_layers.downsample"]
    assert placement.one_at_a_time()  # its inner skip layer writes the head, kept with the glue
    # The trained model's file holds it under both names, as the model's state_dict does.
    state = under_every_name({"input_block.weight": torch.ones(1)}, placement.also)
    assert set(state) == {"input_block.weight", "skip_layers.downsample.weight"}
    replace(model, "input_block", nn.Identity())
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert not any(n.startswith(("input_block.", "skip_layers.downsample.")) for n in names)


@contextmanager
def _world_of_one() -> Iterator[None]:
    """This process as a torch RPC world of one ("master"): distributed autograd contexts."""
    (port,) = free_ports(1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc("master", rank=0, world_size=1, rpc_backend_options=options)
    try:
        yield
    finally:
        rpc.shutdown()


class _Stage:
    """A stage's side of a call (Held.call's, without building a model from a spec)."""

    def __init__(self) -> None:
        self.linear = nn.Linear(4, 4)

    def call(self, name: str, turn: tuple, args: tuple, kwargs: dict) -> torch.Tensor:
        return self.linear(*args, **kwargs)


def test_a_tensor_subclass_crosses_to_a_stage_and_back_with_its_gradient():
    """MONAI's MetaTensor (Tagged, its habit): sent inline, a stage's output came back
    without its autograd link, and the stage's parameters got no gradient."""
    glue, stage = nn.Linear(4, 4), _Stage()
    with _world_of_one(), dist_autograd.context() as context:
        on_stage = remote.OnStage("linear", [("master", rpc.RRef(stage))])
        out = on_stage(glue(traced_cases.Tagged(torch.randn(2, 4), {"file": "a.nii"})))
        assert isinstance(out, traced_cases.Tagged)  # as one process computes it
        dist_autograd.backward(context, [out.sum()])
        grads = dist_autograd.get_gradients(context)
        assert stage.linear.weight in grads and glue.weight in grads


class Racing(skip_heads.SkipHeads):
    """Its forward waits (up to a second), after its skip layers wrote the head, for another
    micro-batch's forward to have written too: forwards run at once read each other's."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards = 0
        self.both = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.output_block(self.skip_layers(x))
        self.forwards += 1
        if self.forwards >= 2:
            self.both.set()
        self.both.wait(1)
        return torch.cat([out, self.heads[0]], dim=1)


def test_forwards_writing_state_the_glue_reads_run_one_at_a_time_as_one_process():
    """DynUNet's heads: with its micro-batches' forwards at once, micro-batch 1's head lands
    in the list before micro-batch 0 reads it (its backward then runs through 1's graph
    twice). One at a time, in order, the step is one process's (a world of one: the glue's
    gradients come from distributed autograd contexts)."""
    torch.manual_seed(0)
    model, plain = Racing(), skip_heads.skip_heads()
    plain.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 4), torch.randn(8, 4)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out - y).square().mean()

    expected = loss_fn(plain(x), y)
    expected.backward()
    norm = sum(p.grad.square().sum() for p in plain.parameters()).sqrt().item()
    with _world_of_one():
        rules = None, nonfinite.Guard()
        none = Stages([[]], [[]])  # every module with the glue: the race is the glue's own
        done = step(model, None, none, [(x, y)], 2, 0, loss_fn, rules, 0.1, one_at_a_time=True)
    assert done.loss == pytest.approx(expected.item(), rel=1e-6)
    assert done.grad_norm == pytest.approx(norm, rel=1e-5)


def _held_layer(**fields) -> tuple[Held, nn.Module]:
    """A stage holding layer 0 of the float32 ESM-like encoder, built as the job builds it."""
    job = spec.parse(_esm_job(model={"import": "userpkg.esmlike:ESM2"}, **fields)).settings
    held = Held(job, ["layers.0"], "cpu")
    return held, held.by_name["layers.0"]


def _layer_call(held: Held) -> torch.Tensor:
    x = torch.randn(2, 6, 32)
    out, attn = held.call("layers.0", (0, 0, 0), (x,), {"self_attn_padding_mask": None})
    assert attn is None
    return out


def test_a_stage_computes_its_modules_in_the_jobs_precision():
    """bf16: a layer's matrix products as under one process's autocast (weights float32)."""
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        held, layer = _held_layer(precision=precision)
        seen = []
        layer.fc1.register_forward_hook(lambda _m, _a, out, s=seen: s.append(out.dtype))
        _layer_call(held)
        assert seen == [dtype] and layer.fc1.weight.dtype == torch.float32


def test_a_stage_recomputes_its_modules_forward_with_activation_checkpointing():
    """The backward runs the layer's forward again (only its inputs were kept)."""
    for recompute, forwards in ((True, 2), (False, 1)):
        held, layer = _held_layer(activationCheckpointing=recompute)
        calls = []
        layer.fc1.register_forward_hook(lambda *_, c=calls: c.append(1))
        _layer_call(held).sum().backward()
        assert len(calls) == forwards and layer.fc1.weight.grad is not None


def _fp16_world(rank: int, envs: list[dict[str, str]], out: str) -> None:
    """fp16 on the eager path: validation asks for GPUs, but torch's CPU autocast computes
    fp16 too, so this world runs the path's fp16 (autocast on the stages and the glue, the
    loss scale, unscaling, an overflowed step not applied) on CPU: a step whose scaled loss
    overflows, then one that does not (test_precision.py's check of the traced path)."""
    if (env := master_of(rank, envs)) is None:
        return
    try:
        env = dataclasses.replace(env, spec=dataclasses.replace(env.spec, precision="fp16"))
        model = models.build(env.spec)
        (x1, y1), (x2, y2) = fp16_batches()
        stages = eager_run.distribute(env, model, place(model, no_grad_run(model, x1[:8]), 2))
        assert not list(model.parameters())  # the glue holds none: every layer on a stage

        def state() -> dict[str, torch.Tensor]:
            return {k: v for part in stages.on_each(remote.state) for k, v in part.items()}

        forward = partial(computed, model, autocast=torch.float16)
        scale, rules = LossScale(scale=2.0**200), (None, nonfinite.Guard())  # inf in float32
        before = state()
        first = step(
            forward, None, stages, [(x1, y1)], 2, 0, F.cross_entropy, rules, 0.5, scale=scale
        )
        overflowed, skipped = scale.scale, state()
        scale.scale = 2.0**16  # torch's GradScaler's start: no overflow
        second = step(
            forward, None, stages, [(x2, y2)], 2, 1, F.cross_entropy, rules, 0.5, scale=scale
        )
        torch.save(
            {
                "first": (first.overflowed, first.grad_norm),
                "overflowed": overflowed,
                "before": before,
                "skipped": skipped,
                "second": (second.applied, second.loss, second.grad_norm),
                "scale": scale.scale,
                "after": state(),
            },
            out,
        )
    finally:
        rpc.shutdown()


def _fp16_eager_envs(name: str, **fields: Any) -> list[dict[str, str]]:
    """The processes' environments of fp16_mlp's 2 stages on the eager path (2 micro-batches
    of 8), with `fields` added to the spec."""
    manifest = pipeline_job(
        name,
        model={"import": "userpkg.fp16_mlp:mlp32", "cut": "eager"},
        engine="rpc",
        stages=2,
        microBatches=2,
        batchSize=16,
        **fields,
    )
    processes = plan.plan_world(
        spec.parse(manifest), lambda m: LOOPBACK, plan.Ports(*free_ports(4))
    )
    return [p.env for p in processes]


def test_fp16_on_the_eager_path_skips_an_overflow_and_unscales_the_gradients(tmp_path):
    """The overflowed step changes no parameter and halves the scale; the next step's loss,
    norm and change of every parameter are float32's to fp16's precision (test_precision's
    2% bound), at the same scale."""
    envs = _fp16_eager_envs("fp16", optimizer={"name": "sgd", "lr": 0.5, "momentum": 0})
    got = run_world(_fp16_world, envs, tmp_path / "fp16.pt")

    assert got["first"][0] and not math.isfinite(got["first"][1])
    assert got["overflowed"] == 2.0**199
    for name, value in got["before"].items():
        assert torch.equal(got["skipped"][name], value), f"{name} changed in a skipped step"
    applied, second_loss, second_norm = got["second"]
    assert applied
    assert_the_second_step_follows_float32s(got, second_loss, second_norm)


def _scale_round_trip_world(rank: int, envs: list[dict[str, str]], out: str) -> None:
    """A checkpoint of the eager path saved with a loss scale its run had moved (halved twice,
    3 good steps since), then resumed into a fresh start's scale (torch's GradScaler's)."""
    if (env := master_of(rank, envs)) is None:
        return
    try:
        model = models.build(env.spec)
        (x, _), _ = fp16_batches()
        placement = place(model, no_grad_run(model, x[:8]), 2)
        stages = eager_run.distribute(env, model, placement)
        moved = eager_run.EagerState(
            model, None, stages, placement, None, LossScale(2.0**14, good=3)
        )
        with data.Feed(env.spec) as feed:
            eager_saved.save(env, 1, moved, feed)
        fresh = eager_run.EagerState(model, None, stages, placement, None, LossScale())
        with data.Feed(env.spec) as feed:
            step = eager_saved.resume(env, checkpoint.latest_for(env), fresh, feed)
        saved_scale = torch.load(f"{checkpoint.step_dir(env.spec.checkpoint.path, 1)}/master.pt")
        torch.save({"step": step, "scale": fresh.scale.state(), "file": saved_scale}, out)
    finally:
        rpc.shutdown()


def test_fp16s_loss_scale_survives_a_checkpoint_on_the_eager_path(tmp_path):
    """master.pt keeps the loss scale and its count of good steps, and a resume continues with
    them, not with a fresh start's 2^16 (which would overflow again, or double too soon)."""
    envs = _fp16_eager_envs("scale", checkpoint={"path": str(tmp_path / "ckpt"), "everySteps": 1})
    got = run_world(_scale_round_trip_world, envs, tmp_path / "scale.pt")
    assert got["file"]["lossScale"] == {"scale": 2.0**14, "good": 3}
    assert got["step"] == 1 and got["scale"] == {"scale": 2.0**14, "good": 3}


def test_a_non_finite_eager_step_names_what_and_where_as_the_traced_path_does():
    """The loss; else the gradient norm, from the latest stage whose gradients are not
    finite (the backward runs back from the master's loss), or the master's glue."""
    workers = ["stage0", "stage1", "stage2"]
    nan, inf = float("nan"), float("inf")
    assert not_finite(1.0, [0.0, 1.0, 2.0, 3.0], workers) is None
    what, _, where = not_finite(nan, [0.0, nan, 2.0, 3.0], workers)
    assert what == "loss" and "forward or its loss" in where
    assert not_finite(1.0, [0.0, nan, inf, 3.0], workers)[::2] == (
        "gradient norm",
        "stage1's backward",
    )
    assert not_finite(1.0, [inf, 1.0, 2.0, 3.0], workers)[2] == "the master's glue's backward"


@pytest.mark.slow  # a world; what and where, in process above; the guard in test_nonfinite.py
def test_a_non_finite_step_on_the_eager_path_is_skipped_as_allowed(tmp_path, monkeypatch):
    """skipNonFiniteSteps: 1, a stage's module passing NaN gradients back in step 3: the
    step is skipped, named, and the trained model is finite."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    args = {"at": 3, "micro_batches": 2, "backward": True}
    job = pipeline_job(
        "skip",
        model={"import": "userpkg.blowup:eager_cnn", "args": args, "cut": "eager"},
        stages=2,
        steps=5,
        microBatches=2,
        skipNonFiniteSteps=1,
        output={"path": str(tmp_path / "out")},
    )
    code, out, summary = run_to_end(job, tmp_path, timeout=300)
    assert code == 0 and summary is not None and summary["path"] == "eager", out[-3000:]
    said = r"step 3: the gradient norm is nan, first non-finite in stage\d's backward: skipped"
    assert re.search(said, out), out[-3000:]
    trained = model_files.load_state_dict(tmp_path / "out")
    assert all(torch.isfinite(v).all() for v in trained.values())


def test_a_stage_keeps_its_moving_average_and_checkpoints_it():
    """spec.ema on a stage: the average moves after each applied step, a swap exchanges it
    with the weights, and a checkpoint keeps it beside the optimizer's state."""
    held, layer = _held_layer(ema={"decay": 0.5}, optimizer={"name": "sgd", "lr": 1.0})
    held.keep_average(spec.parse(_esm_job(ema={"decay": 0.5})).settings.ema)
    before = layer.fc1.bias.detach().clone()
    held.summed = {p: torch.ones_like(p) for p in held.trained}
    held.step(1.0, 1.0)
    torch.testing.assert_close(layer.fc1.bias, before - 1)
    held.swap_average()
    torch.testing.assert_close(layer.fc1.bias, before - 0.5)
    held.swap_average()
    assert sorted(held.kept()) == ["ema", "optimizer"]


def test_plan_says_the_path_where_the_spec_asks_for_it():
    job = spec.parse(_esm_job(model={"import": "userpkg.esmlike:esm2", "cut": "eager"}))
    assert any(line.startswith("path: eager") for line in job.definition.describe(job.settings))
    job = spec.parse(_esm_job())
    assert not any(line.startswith("path:") for line in job.definition.describe(job.settings))
    model = {"import": "userpkg.esmlike:esm2", "cut": "eager"}
    job = spec.parse(_esm_job(model=model, deterministic=True))
    lines = job.definition.describe(job.settings)
    assert any(line.startswith("path: eager") and "counted cost" in line for line in lines)


def test_what_the_eager_path_does_not_carry_is_refused_naming_the_field_never_ignored():
    from pipejob.trainer.pipeline.eager.run import refusal

    assert refusal(spec.parse(_esm_job()).settings) is None
    refused = refusal(spec.parse(_esm_job(profile={"steps": [1], "path": "/tmp/p"})).settings)
    assert refused is not None and "spec.profile" in refused
    assert refusal(spec.parse(_esm_job(precision="fp16", gpusPerStage=1)).settings) is None
    # split points of a trace refused all the same: the eager path places by itself
    refused = refusal(spec.parse(_esm_job(splitPoints=["layers.2"])).settings)
    assert refused is not None and "leave spec.splitPoints out" in refused


def test_the_eager_path_on_the_pipelining_engine_is_refused_naming_the_field():
    manifest = pipeline_job(
        "e", model={"import": "userpkg.esmlike:esm2", "cut": "eager"}, engine="pipelining"
    )
    with pytest.raises(ValueError, match=r"spec.model.cut: the eager path .* rpc engine only"):
        spec.parse(manifest)


@pytest.mark.parametrize(
    "fields, refused",
    [
        ({"profile": {"steps": [1], "path": "/tmp/p"}}, "spec.profile: the eager path"),
        ({"splitPoints": ["layers.2"]}, "spec.splitPoints: the eager path .* no split points"),
    ],
)
def test_asked_for_eager_what_it_does_not_carry_is_refused_before_anything_starts(fields, refused):
    eager = {"import": "userpkg.esmlike:esm2", "cut": "eager"}
    with pytest.raises(ValueError, match=refused):
        spec.parse(_esm_job(model=eager, **fields))
    spec.parse(_esm_job(**fields))  # the traced path carries them


def test_both_paths_carry_fp16():
    eager = {"import": "userpkg.esmlike:esm2", "cut": "eager"}
    spec.parse(_esm_job(model=eager, precision="fp16", gpusPerStage=1))
    spec.parse(_esm_job(precision="fp16", gpusPerStage=1))


def _esm_job(**fields) -> dict:
    defaults = {
        "model": {"import": "userpkg.esmlike:esm2"},
        "data": {"import": "userpkg.esmlike:sequences"},
        "stages": 2,
        "batchSize": 8,
        "microBatches": 4,
        "numClasses": 5,
        "optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0},
    }
    return pipeline_job("esm", **(defaults | fields))


def _one_process_steps(
    manifest: dict, lr: float, steps: int = 1, bf16: bool = False
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """The job's first `steps` SGD steps in one process: each one's loss, and every parameter
    after it. Each of gradientAccumulation's batches (of batchSize x replicas) in replicas x
    microBatches micro-batches, each loss weighted by its share of the step's samples; with
    `bf16`, the forward under autocast, its output to the loss in float32."""
    s = spec.parse(manifest).settings
    model = models.build(s)
    rounds, loss_fn = s.gradient_accumulation, workloads.loss(s)
    m = s.micro_batches * s.replicas.max
    losses, states = [], []
    with data.Feed(s) as feed:
        for _ in range(steps):
            loss = torch.zeros(())
            for _ in range(rounds):
                inputs, labels = feed.batch()
                for x, y in zip(inputs.tensor_split(m), labels.tensor_split(m), strict=True):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        out = model(x)
                    out = float32(out) if bf16 else out
                    loss = loss + loss_fn(out, y) * (len(y) / (len(labels) * rounds))
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
                    p.grad = None
            losses.append(loss.item())
            states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, states


def _one_process_step(
    manifest: dict, lr: float, bf16: bool = False
) -> tuple[float, dict[str, torch.Tensor]]:
    """Step 1 of the job in one process (`_one_process_steps`): its loss and parameters."""
    losses, states = _one_process_steps(manifest, lr, bf16=bf16)
    return losses[0], states[0]


def test_a_model_the_trace_refuses_trains_on_the_eager_path_as_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    out = tmp_path / "out"
    manifest = _esm_job(steps=1, output={"path": str(out)})
    code, output, summary = run_to_end(manifest, tmp_path, timeout=240)
    assert code == 0, output[-3000:]
    assert summary is not None and summary["path"] == "eager"
    assert_fits(summary, eager_run.EagerSummary)  # summary.json's keys are EagerSummary's
    # engine auto, the default: the eager path's engine, said as the cut's choice is
    assert summary["engine"] == "rpc" and summary["engineChosen"] == "the eager path runs on rpc"
    assert "engine auto chose rpc: the eager path runs on rpc" in output
    assert summary["pathReason"].startswith("the trace was refused")
    assert "padding_mask.any()" in summary["pathReason"]
    assert summary["glueParameters"] == 0  # every module with parameters lives on a stage
    assert summary["cutBy"] == "timed"  # spec.deterministic counts instead: test_counted_cut
    loss, expected = _one_process_step(manifest, lr=0.5)
    assert summary["losses"][0] == pytest.approx(loss, rel=1e-12)
    trained = model_files.load_state_dict(out)
    assert sorted(trained) == sorted(models.build(spec.parse(manifest).settings).state_dict())
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-12, atol=1e-12, msg=name)


def test_replicas_and_accumulated_batches_on_the_eager_path_step_as_one_process(
    tmp_path, monkeypatch
):
    """2 replicas of 2 stages, 2 batches per optimizer step, activation checkpointing: step
    1's loss and every parameter after it equal one process's on the step's 32 samples
    (float64), and the replicas stay identical (their gradients summed in replica order,
    each to the same bits)."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    out = tmp_path / "out"
    model = {"import": "userpkg.esmlike:esm2", "cut": "eager"}
    manifest = _esm_job(
        model=model,
        steps=1,
        replicas=2,
        gradientAccumulation=2,
        activationCheckpointing=True,  # the backward recomputes: the same gradients
        output={"path": str(out)},
    )
    code, output, summary = run_to_end(manifest, tmp_path, timeout=300)
    assert code == 0, output[-3000:]
    assert summary is not None and summary["path"] == "eager" and summary["replicas"] == 2
    assert summary["replicaDivergence"] == 0.0
    loss, expected = _one_process_step(manifest, lr=0.5)
    assert summary["losses"][0] == pytest.approx(loss, rel=1e-12)
    trained = model_files.load_state_dict(out)
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.slow  # two worlds; replicas staying identical: the fast replicas test above
def test_two_runs_with_replicas_on_the_eager_path_give_the_same_bits(tmp_path, monkeypatch):
    """Adam over 3 steps of 2 replicas, spec.deterministic: two runs' placements (counted,
    not timed), losses, gradient norms and trained models are equal to the bit (every sum
    in a fixed order, the replicas' in replica order)."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    runs = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        manifest = _esm_job(
            model={"import": "userpkg.esmlike:esm2", "cut": "eager"},
            optimizer={"name": "adam", "lr": 0.01},
            steps=3,
            replicas=2,
            deterministic=True,
            output={"path": str(tmp_path / name / "out")},
        )
        code, output, summary = run_to_end(manifest, tmp_path / name, timeout=300)
        assert code == 0 and summary is not None, output[-3000:]
        assert summary["cutBy"] == "counted" and "placed by counted cost" in output
        runs.append((summary, model_files.load_state_dict(tmp_path / name / "out")))
    (first, one), (second, two) = runs
    assert first["losses"] == second["losses"] and first["gradNorms"] == second["gradNorms"]
    assert first["placement"] == second["placement"]
    assert sorted(one) == sorted(two)
    assert all(torch.equal(one[k], two[k]) for k in one)


@pytest.mark.slow  # a world more; Held's precision: the in-process test above
def test_bf16_on_the_eager_path_computes_as_one_process_under_autocast(tmp_path, monkeypatch):
    """A float32 encoder in bf16: step 1 as one process under autocast (within bf16's
    rounding of another order of sums), not as one in float32."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    out = tmp_path / "out"
    model = {"import": "userpkg.esmlike:ESM2", "cut": "eager"}
    manifest = _esm_job(model=model, steps=1, precision="bf16", output={"path": str(out)})
    code, output, summary = run_to_end(manifest, tmp_path, timeout=300)
    assert code == 0 and summary is not None, output[-3000:]
    loss, expected = _one_process_step(manifest, lr=0.5, bf16=True)
    fp32_loss, fp32_expected = _one_process_step(manifest, lr=0.5)
    assert summary["losses"][0] == pytest.approx(loss, rel=1e-5)
    assert abs(fp32_loss - loss) > 1e-4  # bf16 shows: the check above can tell
    trained = model_files.load_state_dict(out)
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow  # a world; a stage's average, kept and swapped: in process above
def test_the_eager_paths_moving_average_is_one_processes(tmp_path, monkeypatch):
    """spec.ema (decay 0.5, output both) over 2 SGD steps: the output holds the weights and
    ema/ the average of one process's weights after each step; the evaluation reports the
    average's figures beside the weights'."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    out = tmp_path / "out"
    manifest = _esm_job(
        model={"import": "userpkg.esmlike:esm2", "cut": "eager"},
        steps=2,
        ema={"decay": 0.5, "output": "both"},
        eval={"everySteps": 0},
        output={"path": str(out)},
    )
    code, output, summary = run_to_end(manifest, tmp_path, timeout=300)
    assert code == 0 and summary is not None, output[-3000:]
    _, (first, second) = _one_process_steps(manifest, lr=0.5, steps=2)
    initial = dict(models.build(spec.parse(manifest).settings).named_parameters())
    weights, average = model_files.load_state_dict(out), model_files.load_state_dict(out / "ema")
    for name, value in second.items():
        expected = 0.25 * initial[name].detach() + 0.25 * first[name] + 0.5 * value
        torch.testing.assert_close(weights[name], value, rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(average[name], expected, rtol=1e-12, atol=1e-12, msg=name)
    evaluation = summary["evaluation"]
    assert "ema" in evaluation and evaluation["ema"]["loss"] != evaluation["loss"]


@pytest.mark.slow  # a world; the rule itself: test_recipe_best.py, on the traced path
def test_the_eager_path_stops_early_with_the_best_steps_weights_out(tmp_path, monkeypatch):
    """eval.best (the highest held-out loss, as test_recipe_best.py's) and earlyStopping
    (patience 1): the run ends where the rule says, and the output holds the best step's
    weights, one process's after that many steps (float64)."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    out = tmp_path / "out"
    manifest = _esm_job(
        model={"import": "userpkg.esmlike:esm2", "cut": "eager"},
        steps=4,
        eval={
            "everySteps": 1,
            "best": {"metric": "loss", "mode": "max"},
            "earlyStopping": {"patience": 1},
        },
        output={"path": str(out)},
    )
    code, output, summary = run_to_end(manifest, tmp_path, timeout=300)
    assert code == 0 and summary is not None, output[-3000:]
    losses = [e["loss"] for e in summary["evaluations"]]
    stop = next((k for k in range(1, len(losses)) if losses[k] <= max(losses[:k])), None)
    assert stop is not None, f"the held-out loss rose at every step: {losses}"
    best = max(losses[:stop])
    assert summary["steps"] == stop + 1 == len(losses), losses
    assert summary["best"] == {"metric": "loss", "value": best, "step": losses.index(best) + 1}
    _, states = _one_process_steps(manifest, lr=0.5, steps=stop)
    trained = model_files.load_state_dict(out)
    for name, value in states[losses.index(best)].items():
        torch.testing.assert_close(trained[name], value, rtol=1e-12, atol=1e-12, msg=name)


def _losses_and_evaluation(manifest: dict, tmp_path: Path, name: str) -> tuple[list, dict]:
    code, output, summary = run_to_end(manifest, tmp_path / name, timeout=240)
    assert code == 0 and summary is not None, output[-3000:]
    return summary["losses"], summary["evaluation"]


@pytest.mark.slow  # two more worlds; the path, placement and exact step: the test above
def test_a_run_stopped_and_resumed_on_the_eager_path_gives_the_straight_runs_bits(
    tmp_path, monkeypatch
):
    """Adam (state in every process), evaluation, a checkpoint at step 2: steps 3-4 resumed
    from it give the losses and held-out figures of a straight run of 4, to the bit."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    for name in ("straight", "stopped", "resumed"):
        (tmp_path / name).mkdir()

    def job(steps: int, path: Path) -> dict:
        return _esm_job(
            model={"import": "userpkg.esmlike:esm2", "cut": "eager"},
            optimizer={"name": "adam", "lr": 0.01},
            steps=steps,
            eval={"everySteps": 2},
            checkpoint={"path": str(path), "everySteps": 2},
        )

    straight, evaluated = _losses_and_evaluation(job(4, tmp_path / "a"), tmp_path, "straight")
    stopped, _ = _losses_and_evaluation(job(2, tmp_path / "b"), tmp_path, "stopped")
    resumed, again = _losses_and_evaluation(job(4, tmp_path / "b"), tmp_path, "resumed")
    assert stopped + resumed == straight
    assert again == evaluated


@pytest.mark.slow  # two worlds; a resume on the same shape, to the bit: the test above
def test_an_eager_checkpoint_resumes_on_another_stage_and_replica_count(tmp_path, monkeypatch):
    """Elastic: 1 replica of 3 stages checkpoints step 2; a world of 2 replicas of 2 stages
    resumed from it (each replica's stages loading their names) trains steps 3-4 as the
    first world did (float64: the sums differ only in order), reading on where it stopped
    (the losses are of the same batches), its replicas identical."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))

    def job(stages: int, root: Path) -> dict:
        return _esm_job(
            model={"import": "userpkg.esmlike:esm2", "cut": "eager"},
            optimizer={"name": "adam", "lr": 0.01},
            stages=stages,
            steps=4,
            replicas={"min": 1, "max": 2},
            checkpoint={"path": str(root), "everySteps": 2},
        )

    def run(manifest: dict, name: str, size: int) -> dict:
        (tmp_path / name).mkdir()
        with JobRun(manifest, tmp_path / name, args=("--size", str(size))) as job:
            assert job.finish(300) == 0, job.output[-3000:]
            return job.summary()

    first = run(job(3, tmp_path / "a"), "first", 1)
    assert first["replicas"] == 1 and len(first["placement"]) == 3
    stopped = tmp_path / "b"
    shutil.copytree(checkpoint.step_dir(tmp_path / "a", 2), checkpoint.step_dir(stopped, 2))
    resumed = run(job(2, stopped), "resumed", 2)
    assert resumed["replicas"] == 2 and resumed["resumedFromStep"] == 2
    assert resumed["replicaDivergence"] == 0.0
    assert resumed["losses"] == pytest.approx(first["losses"][2:], rel=1e-9)


def resumed_as_straight(
    job: Callable[[Path, Path], dict], tmp_path: Path, timeout: float = 240
) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """`job(checkpoint root, output folder)` run straight (checkpointing after step 2), then
    from a copy of its step-2 checkpoint: the resumed run's losses and trained model equal
    the straight run's to the bit. Both summaries and the trained model."""

    def run(name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        (tmp_path / name).mkdir(exist_ok=True)  # the resumed run's holds its checkpoint
        manifest = job(tmp_path / name / "ckpt", tmp_path / name / "out")
        code, output, summary = run_to_end(manifest, tmp_path / name, timeout=timeout)
        assert code == 0 and summary is not None, output[-3000:]
        return summary, model_files.load_state_dict(tmp_path / name / "out")

    straight, trained = run("straight")
    saved = checkpoint.step_dir(tmp_path / "straight" / "ckpt", 2)
    shutil.copytree(saved, checkpoint.step_dir(tmp_path / "resumed" / "ckpt", 2))
    resumed, again = run("resumed")
    assert resumed["resumedFromStep"] == 2
    assert resumed["losses"] == straight["losses"][2:]
    assert sorted(again) == sorted(trained)
    for name, value in trained.items():
        assert torch.equal(again[name], value), name
    return straight, resumed, again


@pytest.mark.slow  # two worlds; one module under two names, in process: the test above it
def test_a_module_under_two_names_resumes_on_the_eager_path_to_the_bit(tmp_path, monkeypatch):
    """DynUNet's stand-in (input_block is also skip_layers.downsample, and a kept skip layer
    writes the head the glue reads), Adam: steps 3-4 resumed from the step-2 checkpoint of a
    run of 4 give its losses and its trained model to the bit, under both names."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))

    def job(root: Path, out: Path) -> dict:
        return pipeline_job(
            "skip-heads",
            model={"import": "userpkg.skip_heads:skip_heads", "cut": "eager"},
            data={"import": "userpkg.skip_heads:vectors"},
            numClasses=4,
            stages=2,
            microBatches=2,
            optimizer={"name": "adam", "lr": 0.01},
            steps=4,
            checkpoint={"path": str(root), "everySteps": 2},
            output={"path": str(out)},
        )

    straight, resumed, trained = resumed_as_straight(job, tmp_path)
    for summary in (straight, resumed):
        assert summary["path"] == "eager" and summary["forwardsOneAtATime"], summary
    assert sorted(trained) == sorted(skip_heads.skip_heads().state_dict())
    assert torch.equal(trained["input_block.weight"], trained["skip_layers.downsample.weight"])


def test_the_conformance_harness_tries_a_refused_model_on_the_eager_path(monkeypatch):
    """The ESM-like encoder, which the trace refuses: exact on the eager path (benchmarks/
    _conform_eager.py); with the eager path's gradients broken, still refused, saying why."""
    import sys

    monkeypatch.syspath_prepend(str(TESTS.parent / "benchmarks"))
    sys.modules.pop("_conform", None)
    sys.modules.pop("_conform_eager", None)  # imported by another test, with its _conform
    import _conform
    import _conform_eager

    row = _conform.run("esm", "esm2", lambda: esmlike.ESM2(num_layers=2), _tokens)
    assert row.verdict == "eager", row
    assert row.why.startswith("the trace refused it") and row.cuts.startswith("eager: ")

    # The embedding's stage gives its output without its graph: it gets no gradient.
    class Detached(_conform_eager._Copying):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            return out.detach() if isinstance(self.held, nn.Embedding) else out

    monkeypatch.setattr(_conform_eager, "_Copying", Detached)
    row = _conform.run("esm", "esm2", lambda: esmlike.ESM2(num_layers=2), _tokens)
    assert row.verdict == "refused", row
    assert "on the eager path: (c) eager: embed_tokens.weight got no gradient" in row.why, row
