"""GPTs as their repositories ship them, imported from the user's own checkouts (never copied
here): nanoGPT's `model.py`, minGPT's `mingpt/model.py`, llm.c's `train_gpt2.py`, each under
the folder PIPEJOB_SHIPPED_GPTS names (`nanoGPT/`, `minGPT/`, `llm.c/`, as `git clone` lays
them out). Each factory builds its `GPT` from its own config class, small, without dropout,
as a user's training script would; their forwards are `(idx, targets=None) -> (logits,
loss)`."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from torch import nn

FOLDER = "PIPEJOB_SHIPPED_GPTS"
FILES = {
    "nanogpt": "nanoGPT/model.py",
    "mingpt": "minGPT/mingpt/model.py",
    "llmc": "llm.c/train_gpt2.py",
}


def shipped(kind: str) -> Path | None:
    """The shipped file of `kind`, or None where PIPEJOB_SHIPPED_GPTS does not hold it."""
    folder = os.environ.get(FOLDER)
    path = Path(folder) / FILES[kind] if folder else None
    return path if path is not None and path.is_file() else None


def _module(kind: str) -> ModuleType:
    path = shipped(kind)
    if path is None:
        raise FileNotFoundError(f"{FOLDER} holds no {FILES[kind]} (a checkout of the repository)")
    if kind == "mingpt":  # its model imports its package's utils
        sys.path.insert(0, str(path.parents[1]))
        import mingpt.model

        return mingpt.model
    name = f"shipped_{kind}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def build(
    kind: str, vocab: int = 64, length: int = 16, layers: int = 2, heads: int = 2
) -> nn.Module:
    """The repository's GPT, 32 wide."""
    module = _module(kind)
    if kind == "nanogpt":
        config = module.GPTConfig(length, vocab, layers, heads, 32, dropout=0.0, bias=True)
        return module.GPT(config)
    if kind == "mingpt":
        config = module.GPT.get_default_config()
        config.merge_from_dict(
            {"model_type": None, "n_layer": layers, "n_head": heads, "n_embd": 32}
            | {"vocab_size": vocab, "block_size": length}
            | {"embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0}
        )
        return module.GPT(config)
    return module.GPT(module.GPTConfig(length, vocab, layers, heads, 32))
