"""The map-style sources of a PipelineJob's data, each a (dataset, description) of a split:
`imageFolder` (torchvision's ImageFolder, deterministic transforms), `tokens` (a flat
nanoGPT-style file of token ids read as windows of seqLen + 1) and `import` (the user's
map-style Dataset of (input, label) pairs). Every error names the spec field to fix."""

from __future__ import annotations

import functools
import os
from typing import Any, TypedDict

import numpy as np
import torch
from torch.utils.data import Dataset

from pipejob.core.data_sources import Split
from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.workloads import imports

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ValueError):
    """The data the spec names cannot be used; the message names the field."""


def dataset(spec: PipelineSpec, split: str) -> Any:
    """(dataset, description) of a named source's split; None for a held-out split it lacks."""
    d = spec.data
    return (_imported if d.import_ else _image_folder if d.image_folder else _tokens)(spec, split)


def _imported(spec: PipelineSpec, split: str) -> tuple[Any, str] | None:
    field = "spec.data.import"
    dataset = imports.call(spec.data.import_, field, spec.data.args, split=split)
    if dataset is None and split == "val":
        return None
    what = f"{spec.data.import_!r} (split={split!r})"
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise DataError(
            f"{field}: {what} returned {type(dataset).__name__!r}, not a map-style"
            " Dataset (with __len__ and __getitem__)"
        )
    if len(dataset) == 0:
        raise DataError(f"{field}: {what} returned an empty dataset")
    first = dataset[0]
    if not (isinstance(first, tuple | list) and len(first) == 2):
        raise DataError(
            f"{field}: {what}'s item 0 is {type(first).__name__!r}, not an (input, label) pair"
        )
    return dataset, f"import {spec.data.import_} ({split}): {len(dataset):,} samples"


def _path(section: Split | None, name: str, split: str) -> tuple[str, str] | None:
    """The file or folder of `split` in spec.data.<name>, and its field; None if it has none."""
    assert section is not None
    path = section.train if split == "train" else section.val
    return None if path is None else (path, f"spec.data.{name}.{split}")


def _class_folders(path: str) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir())


def _image_folder(spec: PipelineSpec, split: str) -> tuple[Any, str] | None:
    from torchvision import datasets, transforms

    folders = spec.data.image_folder
    if (found := _path(folders, "imageFolder", split)) is None:
        return None
    path, field = found
    if not os.path.isdir(path):
        raise DataError(f"{field}: {path!r} is not a directory")
    size = spec.image_size  # Resize(size): the shorter side; CenterCrop: the square
    transform = transforms.Compose(
        [
            transforms.Resize(size),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    try:
        dataset = datasets.ImageFolder(path, transform=transform)
    except OSError as e:  # no class folders, or a class folder without images
        raise DataError(f"{field}: {path!r}: {e}") from None
    if folders.val is not None and os.path.isdir(folders.val) and os.path.isdir(folders.train):
        # Labels are indices into the sorted class list: other lists would mean other labels.
        train, val = _class_folders(folders.train), _class_folders(folders.val)
        if train != val:
            raise DataError(
                f"spec.data.imageFolder.val: {folders.val!r} has other classes than"
                f" spec.data.imageFolder.train {folders.train!r} (only in train:"
                f" {sorted(set(train) - set(val))}, only in val:"
                f" {sorted(set(val) - set(train))})"
            )
    return dataset, (f"imageFolder {path}: {len(dataset):,} images, {len(dataset.classes)} classes")


class _WindowsState(TypedDict):
    """A `TokenWindows` as it is pickled: its fields, the file not mapped."""

    path: str
    dtype: type[np.unsignedinteger]
    seq_len: int
    tokens: int
    _data: None


class TokenWindows(Dataset):
    """Non-overlapping windows of seq_len + 1 tokens of a flat binary file (window i starts at
    i * seq_len, so consecutive windows share one token): (window[:-1], window[1:]) as int64.
    The file is mapped lazily in each process: a pickled memmap would copy the whole file."""

    def __init__(self, path: str, dtype: str, seq_len: int):
        self.path, self.dtype, self.seq_len = path, TOKEN_DTYPES[dtype], seq_len
        self.tokens = os.path.getsize(path) // np.dtype(self.dtype).itemsize
        self._data: np.ndarray | None = None

    @property
    def data(self) -> np.ndarray:
        if self._data is None:
            self._data = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._data

    def __getstate__(self) -> _WindowsState:
        """Pickled without the mapping: each process maps the file itself."""
        return {**self.__dict__, "_data": None}

    def __len__(self) -> int:
        return (self.tokens - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} outside {len(self)}")
        start = i * self.seq_len
        window = torch.from_numpy(self.data[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


@functools.lru_cache(maxsize=8)
def _largest_token(path: str, dtype: str, size: int, mtime_ns: int) -> int:
    """One pass over the file, once per process (sample, Feed and held_out each open it)."""
    return int(np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r").max())


def _tokens(spec: PipelineSpec, split: str) -> tuple[Any, str] | None:
    tokens = spec.data.tokens
    if (found := _path(tokens, "tokens", split)) is None:
        return None
    path, field = found
    t = spec.model.transformer
    seq_len = tokens.seq_len or (t.seq_len if t is not None else None)
    if seq_len is None:
        raise DataError(
            "spec.data.tokens.seqLen is required: only the built-in transformer"
            " has a seqLen of its own"
        )
    if tokens.dtype not in TOKEN_DTYPES:
        raise DataError(
            f"spec.data.tokens.dtype: {tokens.dtype!r} is not one of {sorted(TOKEN_DTYPES)}"
        )
    if not os.path.isfile(path):
        raise DataError(f"{field}: {path!r} is not a file")
    itemsize, stat = np.dtype(TOKEN_DTYPES[tokens.dtype]).itemsize, os.stat(path)
    size = stat.st_size
    if size % itemsize:
        raise DataError(
            f"{field}: {path!r} holds {size:,} bytes, not a multiple of"
            f" {itemsize} ({tokens.dtype} token ids): is dtype right?"
        )
    dataset = TokenWindows(path, tokens.dtype, seq_len)
    if dataset.tokens < seq_len + 1:
        raise DataError(
            f"{field}: {path!r} holds {dataset.tokens:,} tokens, fewer than one"
            f" window of seqLen + 1 = {seq_len + 1}"
        )
    largest = _largest_token(path, tokens.dtype, stat.st_size, stat.st_mtime_ns)
    if t is not None and largest >= t.vocab_size:  # another model's vocabulary is its own
        raise DataError(
            f"{field}: {path!r} holds token id {largest:,}, outside"
            f" spec.model.transformer.vocabSize {t.vocab_size:,}"
        )
    return dataset, (
        f"tokens {path}: {dataset.tokens:,} {tokens.dtype} tokens,"
        f" {len(dataset):,} windows of {seq_len + 1}"
    )
