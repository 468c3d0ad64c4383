"""Real data a user could bring, made from what ships with the environment (no download):

- `write_digits`: scikit-learn's digits (1,797 real 8x8 images of handwritten digits) as an
  ImageFolder of PNG files with a seeded held-out split;
- `write_stdlib_tokens`: a byte-level uint16 token file (vocabulary 256) made from the Python
  standard library's sources, with a held-out split of other files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

STDLIB = Path(os.__file__).parent
BYTE_VOCAB = 256  # byte-level tokens: every id is a byte


def write_digits(root: Path, val_fraction: float = 0.2, seed: int = 0) -> tuple[Path, Path]:
    """scikit-learn's digits as `root/train/<digit>/<i>.png` and `root/val/<digit>/<i>.png`
    (i: the image's index in `load_digits()`), 8x8 grayscale, 0..16 scaled to 0..255. Each
    digit's images are shuffled by `seed` and `val_fraction` of them held out, so both splits
    hold every class. Returns (train, val); a second call with the same root rewrites them."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.rint(digits.images * (255 / 16)).astype(np.uint8)
    rng = np.random.default_rng(seed)
    train, val = root / "train", root / "val"
    for digit in range(10):
        indices = np.flatnonzero(digits.target == digit)
        rng.shuffle(indices)
        held = round(len(indices) * val_fraction)
        for split, chosen in ((val, indices[:held]), (train, indices[held:])):
            folder = split / str(digit)
            folder.mkdir(parents=True, exist_ok=True)
            for i in chosen:
                Image.fromarray(pixels[i]).save(folder / f"{i}.png")
    return train, val


def stdlib_text(split: str = "train", max_bytes: int = 2_000_000) -> bytes:
    """The standard library's top-level .py sources, sorted by name, concatenated, capped at
    `max_bytes`: every tenth file is "val", the others "train"."""
    files = sorted(STDLIB.glob("*.py"))
    chosen = [f for k, f in enumerate(files) if (k % 10 == 0) == (split == "val")]
    out = bytearray()
    for f in chosen:
        out += f.read_bytes()
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


def write_stdlib_tokens(path: Path, max_bytes: int = 2_000_000, split: str = "train") -> int:
    """`stdlib_text(split, max_bytes)` as a flat uint16 token file (nanoGPT's format, one token
    per byte); the token count."""
    tokens = np.frombuffer(stdlib_text(split, max_bytes), dtype=np.uint8).astype(np.uint16)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens.tofile(path)
    return len(tokens)
