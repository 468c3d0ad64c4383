"""Models as users write them, with the libraries they use (issue 41): a factory that moves
or converts its model, peft's LoRA over a Hugging Face model, a forward that reads another
stage's weight's dtype, a scripted submodule. Each is built the way a stage builds it and
checked in this one process against a plain build (the conformance harness's checks,
benchmarks/_conform.py), in float64."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from userpkg.libraries import (
    ConditionedUNet,
    Scripted,
    lora_llama,
    open_clip_text,
    vit_pytorch,
    x_transformers_decoder,
)

from pipejob.trainer.workloads import cut, materialize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _conform

pytestmark = pytest.mark.timeout(120)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def frozen_first(model: nn.Sequential) -> nn.Sequential:
    model[0].requires_grad_(False)
    return model


def rounded_then_read() -> nn.Sequential:
    model = mlp().half().to(torch.get_default_dtype())  # the values rounded to half's
    model.register_buffer("mean", model[4].bias.detach() * 1.0)  # read after the rounding
    return model


CONVERSIONS = {  # what a training script does to its model before it trains
    "to-device": lambda: mlp().to("cpu"),
    "to-torch-device": lambda: mlp().to(torch.device("cpu")),
    "cpu": lambda: mlp().cpu(),
    "to-dtype-and-device": lambda: mlp().to("cpu", torch.get_default_dtype()),
    "half-then-float": lambda: mlp().half().to(torch.get_default_dtype()),
    "frozen-first-layer": lambda: frozen_first(mlp()).to("cpu"),
    "rounded-then-read": rounded_then_read,
}


def seeded(factory):
    def build() -> nn.Module:
        torch.manual_seed(3)
        return factory()

    return build


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_a_factory_that_moves_or_converts_its_model_builds_as_a_plain_build(name: str) -> None:
    """`.to(device)`, `.cpu()`, `.half()` and `requires_grad_()` in a factory: whatever a
    process keeps (with what its values are computed from) equals a plain build's (value,
    dtype, requires_grad), the rest stays on the meta device, and the random stream ends
    where a plain build's does."""
    build = seeded(CONVERSIONS[name])
    plain, _ = materialize.build(build, None)
    after_plain = torch.rand(3)
    numbered = materialize.numbering(*materialize.build(build, ()))
    expected = {**dict(plain.named_parameters()), **dict(plain.named_buffers())}
    names = sorted(expected)
    for wanted in [names[: len(names) // 2], names[len(names) // 2 :], []]:
        part, _ = materialize.build(build, materialize.numbers(numbered, wanted))
        assert torch.equal(torch.rand(3), after_plain)
        got = {**dict(part.named_parameters()), **dict(part.named_buffers())}
        for key, value in got.items():
            assert value.dtype == expected[key].dtype, key
            assert value.requires_grad == expected[key].requires_grad, key
            if key in wanted:
                assert value.device.type == "cpu" and torch.equal(value, expected[key]), key


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


def test_peft_lora_over_a_causal_lm_cuts_exactly_with_its_base_frozen() -> None:
    """peft moves each adapter to its base layer's device: the build says the device a
    plain build has, so the adapters build, and the cut is exact (state, outputs, step-1
    gradients, output loading back) with the base weights frozen as peft left them."""
    pytest.importorskip("peft")
    row = _conform.run("user", "peft-lora-llama", lora_llama, _tokens)
    assert row.verdict == "exact", row.why
    model, _ = materialize.build(seeded(lora_llama), ())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class ReadsAWeightsMetadata(nn.Module):
    """open_clip's text tower's habit: its forward begins by reading a later block's
    weight's dtype (`get_cast_dtype`), device, size and requires_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        last = self.blocks[-1].fc.weight
        h = self.embed(tokens).to(last.dtype)
        if last.requires_grad and last.is_floating_point():
            h = h + torch.ones(last.shape[1], device=last.device, dtype=last.dtype)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


@pytest.mark.parametrize(
    "factory", [ReadsAWeightsMetadata, open_clip_text], ids=lambda f: f.__name__
)
def test_reading_a_weights_metadata_is_not_a_use(factory) -> None:
    """Only values that flow into the computation place a parameter in a stage: a forward
    that reads another stage's weight's dtype, device, size or requires_grad makes no tie
    (the pipeline would wait for a gradient the reading stage never gets), and the cut is
    exact."""
    if factory is open_clip_text:
        pytest.importorskip("open_clip")
    meta, _ = materialize.build(seeded(factory), ())
    traced = cut.Traced(meta, want=8)
    for start in traced.units[1:]:
        assert cut.ties(traced.split([start])) == [], start
    row = _conform.run("user", factory.__name__, factory, _tokens)
    assert row.verdict == "exact", row.why


def _sum(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return outputs.sum()


def test_the_fit_check_says_what_the_meta_device_cannot_run_and_blames_no_data() -> None:
    """x-transformers' rotary embedding enters `torch.autocast("meta", enabled=False)`,
    which the meta device cannot: the master's fit check says it did not check the fit and
    why (the line), and the cut is exact; data that does not fit is still refused."""
    pytest.importorskip("x_transformers")
    from pipejob.trainer.pipeline.shape_check import fits_model

    model, _ = materialize.build(x_transformers_decoder, ())
    labels = torch.zeros(4, dtype=torch.long)
    note = fits_model(model, _tokens(), labels, _sum)
    assert note is not None and "was not checked" in note and "x_transformers.py" in note, note
    assert "the stages check it on the first batch" in note
    row = _conform.run("user", "x-transformers", x_transformers_decoder, _tokens)
    assert row.verdict == "exact", row.why
    mlp_model, _ = materialize.build(mlp, ())
    assert fits_model(mlp_model, torch.zeros(4, 6), labels, _sum) is None
    with pytest.raises(ValueError, match=r"inputs of shape \(2, 5\) float\d+ do not fit"):
        fits_model(mlp_model, torch.zeros(4, 5), labels, _sum)


def test_a_scripted_submodule_cuts_exactly() -> None:
    row = _conform.run("user", "scripted", Scripted, lambda: torch.randn(4, 6))
    assert row.verdict == "exact", row.why


class Glue(nn.Module):
    """Glue fx alone cannot trace: control flow on sizes read from traced tensors, einops,
    item assignment, a module made in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.mix, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from einops import rearrange

        h = self.conv(x)
        for size in h.shape[-2:]:
            if size % 2:
                raise ValueError("even sizes only")
        _, _, height, width = h.shape
        if height != width:
            h = h.transpose(2, 3)
        h = self.mix(rearrange(h, "b c h w -> b (h w) c"))
        h[:, 0] = 0.0
        return self.head(nn.ReLU()(h).mean(1))


def _images() -> torch.Tensor:
    return torch.randn(4, 3, 4, 6, generator=torch.Generator().manual_seed(0))


def test_glue_traces_with_the_shapes_the_job_knows_and_refuses_another_shape() -> None:
    """Sizes read from traced tensors are concrete with the job's input shape (a batch size
    aside), item assignment and a module made in the forward trace, einops too; the cut is
    exact; and the first stage refuses a batch of another shape than the one traced."""
    pytest.importorskip("einops")
    meta, _ = materialize.build(seeded(Glue), ())
    with pytest.raises(cut.CutError, match="control flow"):
        cut.Traced(meta)  # fx alone
    traced = cut.Traced(meta, sample=_images()[:2])
    assert traced.shaped and traced.units == ["conv", "mix", "head"]
    row = _conform.run("user", "glue", Glue, _images)
    assert row.verdict == "exact", row.why
    first = traced.split(["mix"])[0]
    assert first(torch.randn(5, 3, 4, 6)) is not None  # another batch size
    with pytest.raises(ValueError, match=r"traced for inputs of shape \(batch, 3, 4, 6\)"):
        first(torch.randn(2, 3, 6, 6))


def test_vit_pytorch_cuts_exactly() -> None:
    """einops' `repeat` and `Rearrange` in its forward (issue 41 item 5)."""
    pytest.importorskip("vit_pytorch")
    row = _conform.run("user", "vit-pytorch", vit_pytorch, lambda: torch.randn(4, 3, 8, 8))
    assert row.verdict == "exact", row.why


@pytest.mark.slow
def test_diffusers_conditioned_unet_cuts_exactly() -> None:
    pytest.importorskip("diffusers")
    row = _conform.run("user", "unet2d-condition", ConditionedUNet, lambda: torch.randn(4, 3, 8, 8))
    assert row.verdict == "exact", row.why


class DataDependent(nn.Module):
    """Glue no tracer reads: a branch on the values of a traced tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = -h
        return self.b(h)


class Einops(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from einops import rearrange

        return self.b(rearrange(self.a(x), "b (s c) -> b s c", s=2).flatten(1))


def test_a_refusal_names_the_construct_the_models_line_and_the_way_past() -> None:
    """Issue 41 item 5 of the build: the construct, the line of the model's own source (not
    einops', torch's or pipejob's), and the way past (a split point elsewhere, or
    spec.model.staged)."""
    meta, _ = materialize.build(DataDependent, ())
    with pytest.raises(cut.CutError) as refused:
        cut.Traced(meta, sample=torch.zeros(2, 6))
    said = str(refused.value)
    assert "TraceError" in said and "test_user_libraries.py" in said and "h.sum() > 0" in said
    assert "the way past" in said and "spec.model.staged" in said
    pytest.importorskip("einops")
    meta, _ = materialize.build(Einops, ())
    with pytest.raises(cut.CutError) as refused:
        cut.Traced(meta)  # fx alone, without the job's shapes
    said = str(refused.value)
    assert "einops" in said and "test_user_libraries.py" in said and "_backends.py" not in said
    assert cut.Traced(meta, sample=torch.zeros(2, 6)).units == ["a", "b"]


class Checked(nn.Linear):
    """A layer that runs only in the mode its parent switched it to."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.mode = "sparse"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode != "full":
            raise ValueError("sparse attention needs a longer sequence")
        return super().forward(x)


class Switching(nn.Module):
    """BigBird's habit: its encoder switches its layers' attention by the input's length
    the first time it runs (a setting, not a traced value)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), Checked(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] <= 8:
            self.b.mode = "full"
        return self.b(self.a(x))


class SwitchingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.head = Switching(), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def test_a_forward_that_switches_a_setting_by_shape_keeps_that_module_whole() -> None:
    """The shaped trace would take the switch's branch and then put the setting back; the
    module whose forward switches it is kept whole, so its stage switches as the model
    does, and the cut is exact."""
    meta, _ = materialize.build(SwitchingModel, ())
    traced = cut.Traced(meta, want=4, sample=torch.zeros(2, 6))
    assert "encoder" in traced.whole and "mode" in traced.whole["encoder"]
    row = _conform.run("user", "switching", SwitchingModel, lambda: torch.randn(4, 6))
    assert row.verdict == "exact", row.why


@dataclasses.dataclass
class PerLayer:
    """Gemma 4's config's habit: a global read of a per-layer attribute raises."""

    width: int = 6

    def __getattribute__(self, name: str):
        if name == "width":
            raise RuntimeError("width is per layer: read it from a layer's config")
        return object.__getattribute__(self, name)


def item_mask(h: torch.Tensor, config: PerLayer) -> torch.Tensor:
    """A mask builder that reads a value into Python (the meta device cannot run it)."""
    keep = 1 + int((h[0, 0] * 0).item())
    return torch.ones(h.shape[0], h.shape[1] * keep, dtype=h.dtype, device=h.device)


torch.fx.wrap("item_mask")  # a call of its own in the graph, as transformers' mask builders


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = PerLayer()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        mask = item_mask(h, self.config)
        if mask.shape[1] != h.shape[1]:
            raise ValueError("the mask does not fit")
        return self.b(h * mask)


def test_a_mask_built_off_the_meta_device_and_a_config_that_refuses_reads_trace() -> None:
    """The shaped trace runs a function the meta device cannot (`.item()`) on the CPU for its
    output's shape, and neither walks nor compares a config by reading its attributes."""
    meta, _ = materialize.build(Masked, ())
    traced = cut.Traced(meta, want=4, sample=torch.zeros(2, 6))
    assert traced.shaped and traced.units == ["a", "b"]
    row = _conform.run("user", "masked", Masked, lambda: torch.randn(4, 6))
    assert row.verdict == "exact", row.why


def test_a_factory_that_loads_pretrained_weights_builds_as_a_plain_build(tmp_path: Path) -> None:
    """`from_pretrained` builds on the meta device and marks the weights it loaded, which its
    initialisation then skips: a stage's build draws what a plain build draws, so the LoRA
    adapters peft makes after it start where a plain build's do, with no seed of the user's."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora_llama().base_model.model.save_pretrained(tmp_path)

    def factory() -> nn.Module:
        torch.manual_seed(5)
        base = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
        return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    plain, _ = materialize.build(factory, None)
    adapters = sorted(n for n, p in plain.named_parameters() if p.requires_grad)
    numbered = materialize.numbering(*materialize.build(factory, ()))
    part, _ = materialize.build(factory, materialize.numbers(numbered, adapters))
    got, expected = dict(part.named_parameters()), dict(plain.named_parameters())
    assert adapters and all(torch.equal(got[n], expected[n]) for n in adapters)
