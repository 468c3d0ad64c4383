"""Models as users write them with the libraries they bring (issue 41's eight): a factory
that ends in `.to(device)`, peft's LoRA over a Llama, open_clip's text tower, x-transformers'
decoder, vit-pytorch's ViT, diffusers' conditioned UNet, a `torch.jit.script`-ed submodule
(the packed GRU is userpkg.staged's). Tiny configs; token models read brought.windows
(64 tokens, 16 a window), image models the synthetic images (3 x size x size)."""

from __future__ import annotations

import torch
from torch import nn


def moved(inputs: int = 3 * 32 * 32, classes: int = 3) -> nn.Module:
    """A training script's habit: the model built, then moved to the device."""
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(inputs, 16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, classes),
    )
    return model.to(torch.device("cpu"))


def lora_llama(length: int = 16) -> nn.Module:
    """The most common fine-tuning today: peft LoRA (r=8, q_proj and v_proj) over a Llama."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=length,
    )
    config._attn_implementation = "eager"
    return get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    )


def open_clip_text(length: int = 8, classes: int = 3) -> nn.Module:
    """open_clip's text tower and a head: its forward reads a weight's dtype first."""
    import open_clip

    text = open_clip.model.CLIPTextCfg(
        context_length=length, vocab_size=64, width=16, heads=2, layers=2
    )
    tower = open_clip.model._build_text_tower(embed_dim=8, text_cfg=text)
    return nn.Sequential(tower, nn.Linear(8, classes))


def x_transformers_decoder() -> nn.Module:
    """Rotary embeddings that enter `torch.autocast` on the meta device."""
    from x_transformers import Decoder, TransformerWrapper

    return TransformerWrapper(
        num_tokens=64,
        max_seq_len=16,
        attn_layers=Decoder(dim=16, depth=2, heads=2, rotary_pos_emb=True),
    )


def vit_pytorch(size: int = 8, classes: int = 3) -> nn.Module:
    """einops' `repeat` and `Rearrange` in its forward."""
    from vit_pytorch import ViT

    return ViT(
        image_size=size,
        patch_size=size // 2,
        num_classes=classes,
        dim=8,
        depth=1,
        heads=2,
        mlp_dim=8,
        dim_head=4,
    )


class ConditionedUNet(nn.Module):
    """diffusers' UNet2DConditionModel with a fixed timestep and conditioning, as a training
    wrapper holds them: its forward loops over `sample.shape[-2:]`. `pooled`: the output's
    mean over the image, one logit a channel (a classifier's loss fits it)."""

    def __init__(self, size: int = 8, pooled: bool = False) -> None:
        super().__init__()
        from diffusers import UNet2DConditionModel

        self.unet = UNet2DConditionModel(
            sample_size=size,
            in_channels=3,
            out_channels=3,
            layers_per_block=1,
            block_out_channels=(8, 16),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=8,
            attention_head_dim=2,
            norm_num_groups=4,
        )
        self.register_buffer("condition", torch.randn(1, 4, 8))
        self.pooled = pooled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        condition = self.condition.expand(x.shape[0], -1, -1)
        sample = self.unet(x, 10, encoder_hidden_states=condition).sample
        return sample.mean((2, 3)) if self.pooled else sample


class Scripted(nn.Module):
    """A `torch.jit.script`-ed submodule between two layers."""

    def __init__(self, inputs: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(inputs, 8), nn.Linear(8, classes)
        self.act = torch.jit.script(nn.Sequential(nn.ReLU()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x.flatten(1))))
