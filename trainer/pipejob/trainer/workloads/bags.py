"""spec.embedding's bags from the user: .npz files in EmbeddingBag's own input layout (`ids`,
`offsets`, `labels`, written with one `np.savez`), checked whole on load so a bad one fails
before the first step naming its field, or a Dataset from the user's factory. Both give what
`synthetic.SyntheticBags` gives (a `size` and `sample(i)` -> (ids, label)), which samples.py
reads alike. The format: docs/user-guide.md, "Your bags"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipejob.core.kinds.hybrid import HybridSpec

FORMAT = "np.savez(path, ids=ids, offsets=offsets, labels=labels)"


class FileBags:
    """Bags from one .npz file in EmbeddingBag's layout (see the module docstring)."""

    def __init__(self, path: str, field: str, num_embeddings: int):
        self.path, self.field = path, field
        arrays = _load(path, field)
        ids, offsets, labels = (arrays[k] for k in ("ids", "offsets", "labels"))
        where = f"{field}: {path}"
        if labels.size == 0:
            raise ValueError(f"{where}: holds no bags (labels is empty)")
        for name, a in (("ids", ids), ("offsets", offsets), ("labels", labels)):
            if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
                raise ValueError(
                    f"{where}: {name} must be a 1-d array of integers, got"
                    f" {a.dtype} of shape {a.shape}"
                )
        if len(offsets) != len(labels):
            raise ValueError(
                f"{where}: {len(offsets)} offsets but {len(labels)} labels:"
                " one offset and one label per bag"
            )
        if offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] > len(ids):
            raise ValueError(
                f"{where}: offsets must start at 0, never decrease and stay within"
                f" the {len(ids)} ids (where each bag starts in ids)"
            )
        if len(ids) and (ids.min() < 0 or ids.max() >= num_embeddings):
            bad = int(ids.max()) if ids.max() >= num_embeddings else int(ids.min())
            raise ValueError(
                f"{where}: id {bad} is outside the table's rows 0.."
                f"{num_embeddings - 1} (spec.embedding.numEmbeddings)"
            )
        if labels.min() < 0:
            raise ValueError(f"{where}: labels must be classes 0, 1, ..., got {labels.min()}")
        self.ids = ids.astype(np.int64)
        self.bounds = np.append(offsets, len(ids)).astype(np.int64)
        self.labels = labels.astype(np.int64)

    @property
    def size(self) -> int:
        return len(self.labels)

    def sample(self, i: int) -> tuple[list[int], int]:
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} outside {self.path}'s {self.size} bags")
        return self.ids[self.bounds[i] : self.bounds[i + 1]].tolist(), int(self.labels[i])


def _load(path: str, field: str) -> dict[str, np.ndarray]:
    if not Path(path).is_file():
        raise ValueError(f"{field}: {path}: no such file (write it with {FORMAT})")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as e:  # not a zip, a pickled array, ...
        raise ValueError(
            f"{field}: {path} is not an .npz file of arrays ({FORMAT}): {type(e).__name__}: {e}"
        ) from None
    missing = [k for k in ("ids", "offsets", "labels") if k not in arrays]
    if missing:
        raise ValueError(
            f"{field}: {path} lacks the array(s) {', '.join(missing)} (it has"
            f" {', '.join(arrays) or 'none'}); write it with {FORMAT}"
        )
    return arrays


class Imported:
    """The user's map-style Dataset, checked as it is read: a bad item names the field,
    the split and its index."""

    def __init__(self, dataset: Any, field: str, split: str):
        self.dataset, self.field, self.split = dataset, field, split
        try:
            self._size = len(dataset)
        except TypeError:
            raise TypeError(
                f"{field}: the {split} split is a {type(dataset).__name__}, not a"
                " map-style Dataset (it has no len())"
            ) from None
        if self._size == 0:
            raise ValueError(f"{field}: the {split} split is empty")

    @property
    def size(self) -> int:
        return self._size

    def where(self, i: int) -> str:
        return f"{self.field}: item {i} of the {self.split} split"


def _ids(value: Any) -> list[int]:
    return torch.as_tensor(value, dtype=torch.long).reshape(-1).tolist()


class ImportedBags(Imported):
    """spec.embedding's bags: item i is (ids, label), the ids a list or a 1-d tensor of ints."""

    def __init__(self, dataset: Any, field: str, split: str, num_embeddings: int):
        super().__init__(dataset, field, split)
        self.num_embeddings = num_embeddings

    def sample(self, i: int) -> tuple[list[int], int]:
        try:
            ids, label = self.dataset[i]
            bag, label = _ids(ids), int(label)
        except Exception as e:
            raise ValueError(
                f"{self.where(i)} is not (ids, label) with integer ids and an"
                f" integer label: {type(e).__name__}: {e}"
            ) from None
        if any(not 0 <= x < self.num_embeddings for x in bag):
            last = self.num_embeddings - 1
            raise ValueError(
                f"{self.where(i)}: ids {bag} go outside the table's rows 0..{last}"
                " (spec.embedding.numEmbeddings)"
            )
        if label < 0:
            raise ValueError(f"{self.where(i)}: label {label} is negative")
        return bag, label


class ImportedClicks(Imported):
    """spec.embeddings' samples: item i is (dense features, {feature: ids}, label), the
    dense features and each feature's ids lists or 1-d tensors, the label 0 or 1. A feature's
    ids lie below the rows of every table it feeds (`rows`: the fewest by feature)."""

    def __init__(self, dataset: Any, field: str, split: str, rows: dict[str, int]):
        super().__init__(dataset, field, split)
        self.rows = rows

    def sample(self, i: int) -> tuple[list[float], dict[str, list[int]], int]:
        try:
            values, sparse, label = self.dataset[i]
            dense = torch.as_tensor(values, dtype=torch.float64).reshape(-1).tolist()
            ids = {str(f): _ids(v) for f, v in dict(sparse).items()}
            label = int(label)
        except Exception as e:
            raise ValueError(
                f"{self.where(i)} is not (dense features, {{feature: ids}},"
                f" label): {type(e).__name__}: {e}"
            ) from None
        for feature, rows in self.rows.items():
            bad = [x for x in ids.get(feature, []) if not 0 <= x < rows]
            if bad:
                raise ValueError(
                    f"{self.where(i)}: feature {feature!r} has ids {bad} outside"
                    f" 0..{rows - 1} (the rows of its smallest table)"
                )
        if label not in (0, 1):
            raise ValueError(f"{self.where(i)}: label {label} is not a click (0 or 1)")
        return dense, ids, label


def held_out_size(spec: HybridSpec) -> int:
    """Synthetic held-out samples: a tenth of the training set, at least one batch."""
    return max(spec.batch_size, spec.dataset_size // 10)
