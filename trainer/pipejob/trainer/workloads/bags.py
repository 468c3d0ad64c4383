"""A HybridJob's bags from the user: .npz files, or a Dataset from the user's factory.

Both give what the trainers read from synthetic bags (`synthetic.SyntheticBags`): a `size`
and `sample(i)` -> (the bag's embedding ids, its label), so `synthetic.stream` (each step's
batch, shared among the trainers by DDP rank) serves every source alike.

The file format is EmbeddingBag's own input layout, written in one line with numpy:

    np.savez(path, ids=ids, offsets=offsets, labels=labels)

`ids` holds every bag's embedding ids concatenated (integers below embedding.numEmbeddings),
`offsets` where each bag starts in `ids` (integers, the first 0, never decreasing: an empty
bag is allowed, as in EmbeddingBag), `labels` one integer class per bag (at least 0). The
file is checked whole on load, so a bad one fails before the first step, naming its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.trainer.workloads import imports
from pipejob.trainer.workloads.synthetic import Batch, SyntheticBags, gather

FORMAT = "np.savez(path, ids=ids, offsets=offsets, labels=labels)"


class Bags(Protocol):
    """What the trainers read: `size` samples, each (embedding ids, label)."""

    @property
    def size(self) -> int: ...

    def sample(self, i: int) -> tuple[list[int], int]: ...


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
                raise ValueError(f"{where}: {name} must be a 1-d array of integers, got"
                                 f" {a.dtype} of shape {a.shape}")  # fmt: skip
        if len(offsets) != len(labels):
            raise ValueError(f"{where}: {len(offsets)} offsets but {len(labels)} labels:"
                             " one offset and one label per bag")  # fmt: skip
        if offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] > len(ids):
            raise ValueError(f"{where}: offsets must start at 0, never decrease and stay within"
                             f" the {len(ids)} ids (where each bag starts in ids)")  # fmt: skip
        if len(ids) and (ids.min() < 0 or ids.max() >= num_embeddings):
            bad = int(ids.max()) if ids.max() >= num_embeddings else int(ids.min())
            raise ValueError(f"{where}: id {bad} is outside the table's rows 0.."
                             f"{num_embeddings - 1} (spec.embedding.numEmbeddings)")  # fmt: skip
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
        raise ValueError(f"{field}: {path} is not an .npz file of arrays ({FORMAT}):"
                         f" {type(e).__name__}: {e}") from None  # fmt: skip
    missing = [k for k in ("ids", "offsets", "labels") if k not in arrays]
    if missing:
        raise ValueError(f"{field}: {path} lacks the array(s) {', '.join(missing)} (it has"
                         f" {', '.join(arrays) or 'none'}); write it with {FORMAT}")  # fmt: skip
    return arrays


class ImportedBags:
    """Bags from the user's map-style Dataset: item i is (ids, label), the ids a list or a
    1-d tensor of ints. Checked as they are read: a bad item names the field and its index."""

    def __init__(self, dataset: Any, field: str, split: str, num_embeddings: int):
        self.dataset, self.field, self.split = dataset, field, split
        self.num_embeddings = num_embeddings
        try:
            self._size = len(dataset)
        except TypeError:
            raise TypeError(f"{field}: the {split} split is a {type(dataset).__name__}, not a"
                            " map-style Dataset (it has no len())") from None  # fmt: skip
        if self._size == 0:
            raise ValueError(f"{field}: the {split} split is empty")

    @property
    def size(self) -> int:
        return self._size

    def sample(self, i: int) -> tuple[list[int], int]:
        where = f"{self.field}: item {i} of the {self.split} split"
        try:
            ids, label = self.dataset[i]
            bag = torch.as_tensor(ids, dtype=torch.long).reshape(-1).tolist()
            label = int(label)
        except Exception as e:
            raise ValueError(f"{where} is not (ids, label) with integer ids and an integer"
                             f" label: {type(e).__name__}: {e}") from None  # fmt: skip
        if any(not 0 <= x < self.num_embeddings for x in bag):
            last = self.num_embeddings - 1
            raise ValueError(f"{where}: ids {bag} go outside the table's rows 0..{last}"
                             " (spec.embedding.numEmbeddings)")  # fmt: skip
        if label < 0:
            raise ValueError(f"{where}: label {label} is negative")
        return bag, label


def data(spec: HybridSpec, split: str) -> Bags | None:
    """The `split` ("train" or "val") of the spec's data source; None when it has no
    held-out set. Synthetic bags (the default) hold out `held_out_size` bags drawn with
    another seed."""
    d, rows = spec.data, spec.embedding.num_embeddings
    if d.file is not None:
        path = d.file.train if split == "train" else d.file.val
        return None if path is None else FileBags(path, f"spec.data.file.{split}", rows)
    if d.import_ is not None:
        dataset = imports.call(d.import_, "spec.data.import", d.args, split=split)
        return None if dataset is None else ImportedBags(dataset, "spec.data.import", split, rows)
    size = spec.dataset_size if split == "train" else held_out_size(spec)
    # Seeds are >= 0: -1 - seed is a stream no training set is drawn from.
    seed = spec.seed if split == "train" else -1 - spec.seed
    return SyntheticBags(size=size, num_embeddings=rows, classes=spec.dense.out_features,
                         bag_size=spec.bag_size, seed=seed)  # fmt: skip


def held_out_size(spec: HybridSpec) -> int:
    """Synthetic held-out bags: a tenth of the training set, at least one batch."""
    return max(spec.batch_size, spec.dataset_size // 10)


def in_order(bags: Bags, batch_size: int, limit: int = 0) -> list[Batch]:
    """`bags` in order as batches of `batch_size` (the last may be smaller); only the first
    `limit` batches when it is not 0. For evaluation: every bag once, no cycling."""
    count = -(-bags.size // batch_size)
    count = min(count, limit) if limit else count
    return [gather(bags, list(range(b * batch_size, min((b + 1) * batch_size, bags.size))))
            for b in range(count)]  # fmt: skip
