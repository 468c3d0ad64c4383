"""The zoos of libraries users bring beside the four big ones (issue 41), for
benchmarks/conformance.py, each model from a tiny config, random weights, a batch of 4:

- diffusers: UNet2DModel and UNet2DConditionModel (a fixed timestep and conditioning, as a
  training wrapper holds them), AutoencoderKL;
- peft: LoRA (rank 4, every linear layer) over a sample of the transformers rows;
- open_clip: its text tower and its vision tower, each with a head;
- x_transformers: a decoder and an encoder (rotary embeddings, autocast on the meta device);
- vit_pytorch: ViT and SimpleViT (einops in their forward);
- segmentation_models_pytorch: Unet and FPN over a ResNet-18 encoder;
- issue 56's, each as tests/userpkg/*_models.py build it for its jobs, at the versions
  benchmarks/requirements-libraries.txt pins: monai (UNet fed MetaTensors, DynUNet with deep
  supervision), kornia (gaussian_blur2d in a forward), torchtune (Llama 3.2 with LoRA and a
  tied, frozen embedding), esm (fair-esm's ESM2), pytorch_tabnet (TabNet's (logits, M_loss))."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Entry = tuple[Callable[[], nn.Module], Callable[[], Any]]
LIBRARIES = (
    "diffusers",
    "peft",
    "open_clip",
    "x_transformers",
    "vit_pytorch",
    "segmentation_models_pytorch",
    "monai",
    "kornia",
    "torchtune",
    "esm",
    "pytorch_tabnet",
)
PEFT_ROWS = ("causal:llama", "causal:gpt2", "classification:bert", "seq2seq:t5")
# Issue 56's rows, named without their library (the docs' table is checked where it is absent).
USER_ROWS = {
    "monai": ("UNet (MetaTensor data)", "DynUNet (deep supervision)"),
    "kornia": ("gaussian_blur2d in a forward",),
    "torchtune": ("lora_llama3_2 (tied, frozen)",),
    "esm": ("ESM2",),
    "pytorch_tabnet": ("TabNet",),
}


def _images(size: int, channels: int = 3) -> Callable[[], torch.Tensor]:
    def sample() -> torch.Tensor:
        return torch.randn(4, channels, size, size, generator=torch.Generator().manual_seed(0))

    return sample


def _tokens(vocab: int, length: int = 8) -> Callable[[], torch.Tensor]:
    def sample() -> torch.Tensor:
        return torch.randint(0, vocab, (4, length), generator=torch.Generator().manual_seed(0))

    return sample


class _Timestep(nn.Module):
    """A diffusion model called as training calls it: a fixed timestep (and conditioning),
    returning its output's `sample`."""

    def __init__(self, unet: nn.Module, condition: int = 0):
        super().__init__()
        self.unet = unet
        self.condition = condition
        if condition:
            self.register_buffer("context", torch.randn(1, 4, condition))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.condition:
            return self.unet(x, 10).sample
        context = self.context.expand(x.shape[0], -1, -1)
        return self.unet(x, 10, encoder_hidden_states=context).sample


def _diffusers() -> dict[str, Entry]:
    import diffusers

    small = {"block_out_channels": (8, 16), "norm_num_groups": 4, "layers_per_block": 1}
    return {
        "UNet2DModel": (
            lambda: _Timestep(
                diffusers.UNet2DModel(
                    sample_size=8,
                    in_channels=3,
                    out_channels=3,
                    attention_head_dim=2,
                    down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                    up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                    **small,
                )
            ),
            _images(8),
        ),
        "UNet2DConditionModel": (
            lambda: _Timestep(
                diffusers.UNet2DConditionModel(
                    sample_size=8,
                    in_channels=3,
                    out_channels=3,
                    cross_attention_dim=8,
                    attention_head_dim=2,
                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                    **small,
                ),
                8,
            ),
            _images(8),
        ),
        "AutoencoderKL": (
            lambda: diffusers.AutoencoderKL(
                in_channels=3,
                out_channels=3,
                latent_channels=2,
                down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2,
                **small,
            ),
            _images(8),
        ),
    }


def _peft(row: str) -> Entry:
    import _zoos
    from peft import LoraConfig, get_peft_model

    base, sample = _zoos.entry("transformers", row)[1]

    def factory() -> nn.Module:
        return get_peft_model(base(), LoraConfig(r=4, target_modules="all-linear"))

    return factory, sample


def _open_clip() -> dict[str, Entry]:
    import open_clip

    def text() -> nn.Module:
        config = open_clip.model.CLIPTextCfg(
            context_length=8, vocab_size=64, width=16, heads=2, layers=2
        )
        return nn.Sequential(open_clip.model._build_text_tower(8, config), nn.Linear(8, 3))

    def vision() -> nn.Module:
        config = open_clip.model.CLIPVisionCfg(
            layers=2, width=16, head_width=8, image_size=16, patch_size=8
        )
        return nn.Sequential(open_clip.model._build_vision_tower(8, config), nn.Linear(8, 3))

    return {"text tower": (text, _tokens(64)), "vision tower": (vision, _images(16))}


def _x_transformers() -> dict[str, Entry]:
    from x_transformers import Decoder, Encoder, TransformerWrapper

    def wrapper(layers: type) -> nn.Module:
        return TransformerWrapper(
            num_tokens=64,
            max_seq_len=16,
            attn_layers=layers(dim=16, depth=2, heads=2, rotary_pos_emb=True),
        )

    return {
        "decoder": (lambda: wrapper(Decoder), _tokens(64)),
        "encoder": (lambda: wrapper(Encoder), _tokens(64)),
    }


def _vit_pytorch() -> dict[str, Entry]:
    from vit_pytorch import SimpleViT, ViT

    small = {
        "image_size": 8,
        "patch_size": 4,
        "num_classes": 3,
        "dim": 8,
        "depth": 1,
        "heads": 2,
        "mlp_dim": 8,
        "dim_head": 4,
    }
    return {
        "ViT": (lambda: ViT(**small), _images(8)),
        "SimpleViT": (lambda: SimpleViT(**small), _images(8)),
    }


def _segmentation() -> dict[str, Entry]:
    import segmentation_models_pytorch as smp

    small = {"encoder_name": "resnet18", "encoder_weights": None, "classes": 2, "encoder_depth": 3}
    return {
        "Unet": (lambda: smp.Unet(decoder_channels=(16, 8, 4), **small), _images(32)),
        "FPN": (
            lambda: smp.FPN(decoder_pyramid_channels=16, decoder_segmentation_channels=32, **small),
            _images(32),
        ),
    }


def _user_models(library: str) -> dict[str, Entry]:
    """Issue 56's rows: the tests' user factories (tests/userpkg/*_models.py), each fed a
    batch of its own data as their jobs read it."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    m = importlib.import_module(f"userpkg.{library.removeprefix('pytorch_')}_models")

    def first(dataset: Callable[[str], Any]) -> Callable[[], Any]:
        def sample() -> Any:  # in the check's dtype, a MetaTensor kept one
            samples = dataset("train")
            x = torch.utils.data.default_collate([samples[i][0] for i in range(4)])
            return x.to(torch.get_default_dtype()) if x.is_floating_point() else x

        return sample

    if library == "monai":
        return {
            "UNet (MetaTensor data)": (m.unet, first(m.segmentation)),
            "DynUNet (deep supervision)": (m.dynunet, _images(16, 1)),
        }
    return {
        "kornia": lambda: {"gaussian_blur2d in a forward": (m.blurred, _images(16))},
        "torchtune": lambda: {"lora_llama3_2 (tied, frozen)": (m.lora_llama, _tokens(64, 16))},
        "esm": lambda: {"ESM2": (m.esm2, first(m.proteins))},
        "pytorch_tabnet": lambda: {"TabNet": (m.tabnet, first(m.table))},
    }[library]()


def _zoo(library: str) -> dict[str, Entry] | None:
    if library in USER_ROWS:
        return _user_models(library)
    makers: dict[str, Callable[[], dict[str, Entry]]] = {
        "diffusers": _diffusers,
        "open_clip": _open_clip,
        "x_transformers": _x_transformers,
        "vit_pytorch": _vit_pytorch,
        "segmentation_models_pytorch": _segmentation,
    }
    return makers[library]() if library in makers else None


def names(library: str) -> list[str]:
    """The rows of a library's zoo, in order."""
    if library == "peft":
        return [f"lora {row}" for row in PEFT_ROWS]
    if library in USER_ROWS:
        return list(USER_ROWS[library])
    zoo = _zoo(library)
    assert zoo is not None
    return list(zoo)


def entry(library: str, name: str) -> Entry:
    if library == "peft":
        return _peft(name.removeprefix("lora "))
    zoo = _zoo(library)
    assert zoo is not None
    return zoo[name]
