"""A Hugging Face causal language model built from its config (random initialisation, no
download): GPT-2's architecture over bytes (vocabulary 256), with its default tied input and
output embeddings. pipejob cuts it between its transformer blocks and trains the tied pair
across the first and last stage; the output folder loads with
`GPT2LMHeadModel.from_pretrained(path)`."""

from __future__ import annotations

from transformers import GPT2Config, GPT2LMHeadModel


def gpt2_bytes(
    layers: int = 4, width: int = 128, heads: int = 4, context: int = 128, dropout: float = 0.0
) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=256,
        n_positions=context,
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=10,
        eos_token_id=10,
        pad_token_id=10,  # a newline ends a line
    )
    return GPT2LMHeadModel(config)
