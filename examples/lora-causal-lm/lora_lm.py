"""LoRA fine-tuning of a Hugging Face causal language model, as peft users do it: the base
model loaded with `from_pretrained` from a local folder (`python base.py` writes one: no hub),
wrapped with peft's LoRA on the attention's q_proj and v_proj, its base weights frozen. pipejob
cuts it into stages like any model; only the adapters get gradients and optimizer state, and
the output folder holds the adapters as `PeftModel.save_pretrained` writes them (and, with
`output.merged: true`, the merged model in `merged/`).

`lora: false` trains the same base model fully instead (the guide compares the stages' peak
memory of the two)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent


def model(
    base: str = "base", lora: bool = True, r: int = 8, alpha: int = 16, seed: int = 0
) -> nn.Module:
    """The base model from `base` (relative to this folder), with LoRA adapters unless
    `lora` is false; the adapters' initial values drawn from `seed`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # one bar per process and load: noise in the job's log

    folder = Path(base) if Path(base).is_absolute() else HERE / base
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no base model in {folder}: run `python base.py` first")
    pretrained = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    if not lora:
        return pretrained
    torch.manual_seed(seed)  # the adapters' initial values: the same at any seed of the job
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(pretrained, config)
