"""torchtune's LoRA recipe on a small Llama 3.2: its output tied to the token embedding, the
base frozen and the adapters trained (set_trainable_params over get_adapter_params), so the
tied weight on the first and last stages needs no gradient (issue 56, class 4)."""

from __future__ import annotations

from torch import nn
from torchtune.models.llama3_2 import lora_llama3_2
from torchtune.modules.peft import get_adapter_params, set_trainable_params


def lora_llama(length: int = 16) -> nn.Module:
    model = lora_llama3_2(
        lora_attn_modules=["q_proj", "v_proj"],
        vocab_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=32,
        max_seq_len=length,
        intermediate_dim=64,
        lora_rank=4,
        lora_alpha=8,
        tie_word_embeddings=True,
    )
    set_trainable_params(model, get_adapter_params(model))
    return model
