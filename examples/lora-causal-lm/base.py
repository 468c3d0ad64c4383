"""Writes what the recipe fine-tunes, with no download: a Llama-architecture causal language
model over bytes (vocabulary 256) saved with `save_pretrained` in `base/` (a stand-in for a
pretrained checkpoint you would bring), and byte-level token files (nanoGPT's format) of the
Python standard library's own sources in `data/`, every tenth file held out.

    python base.py                       # the recipe's size: 4 layers, width 128
    python base.py --layers 8 --width 1024  # the guide's memory comparison
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def write_base(folder: Path, layers: int, width: int, seed: int = 0) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 32),
        num_key_value_heads=max(1, width // 32),
        max_position_embeddings=512,
        bos_token_id=10,
        eos_token_id=10,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)


def write_tokens(folder: Path, max_bytes: int = 2_000_000) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    files = sorted(Path(os.__file__).parent.glob("*.py"))
    for split, held in (("train", False), ("val", True)):
        data = bytearray()
        for f in (f for k, f in enumerate(files) if (k % 10 == 0) == held):
            data += f.read_bytes()
            if len(data) >= max_bytes:
                break
        np.frombuffer(bytes(data[:max_bytes]), np.uint8).astype(np.uint16).tofile(
            folder / f"{split}.bin"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--out", type=Path, default=HERE / "base")
    args = parser.parse_args()
    write_base(args.out, args.layers, args.width)
    write_tokens(HERE / "data")
    print(f"base model in {args.out}, token files in {HERE / 'data'}")


if __name__ == "__main__":
    main()
