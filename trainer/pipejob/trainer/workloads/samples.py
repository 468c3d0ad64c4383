"""A HybridJob's samples as its trainers read them, whatever the source (synthetic, .npz
bags, Criteo logs, the user's Dataset): one seeded stream of them (`stream`), each trainer
taking its share of every step's batch, a position resuming at any trainer count; a batch
holds each feature's ids in EmbeddingBag's layout. How: docs/architecture.md, "The data's
order"."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from pipejob.core.kinds.hybrid import BAGS, HybridSpec
from pipejob.trainer.workloads import criteo, imports
from pipejob.trainer.workloads.bags import FileBags, ImportedBags, ImportedClicks, held_out_size
from pipejob.trainer.workloads.clicklogs import ClickLogs
from pipejob.trainer.workloads.synthetic import SyntheticBags, SyntheticClicks, share_of

Sample = tuple[Sequence[float], dict[str, list[int]], int | float]


class Samples(Protocol):
    """What the trainers read: `size` samples, each (dense features, {feature: ids}, label)."""

    @property
    def size(self) -> int: ...

    def sample(self, i: int) -> Sample: ...


class Bags(Protocol):
    """spec.embedding's bags: `size` samples, each (ids, label)."""

    @property
    def size(self) -> int: ...

    def sample(self, i: int) -> tuple[list[int], int]: ...


@dataclass(frozen=True)
class OneFeature:
    """Bags as samples with no dense features and one feature, `feature`."""

    bags: Bags
    feature: str

    @property
    def size(self) -> int:
        return self.bags.size

    def sample(self, i: int) -> Sample:
        ids, label = self.bags.sample(i)
        return (), {self.feature: ids}, label


@dataclass(frozen=True)
class Batch:
    sample_ids: list[int]
    dense: torch.Tensor  # (batch, dense features)
    ids: dict[str, torch.Tensor]  # by feature: every sample's ids, concatenated (int64)
    lengths: dict[str, torch.Tensor]  # by feature: how many ids each sample has (int64)
    labels: torch.Tensor  # (batch,): int64 classes, or clicks 0.0/1.0
    epochs: list[int] = field(default_factory=list)  # the pass over the data of each sample

    def offsets(self, feature: str) -> torch.Tensor:
        """Where each sample's ids start in ids[feature] (EmbeddingBag's offsets)."""
        lengths = self.lengths[feature]
        return torch.cumsum(lengths, 0) - lengths


def collate(data: Samples, chosen: list[int], features: Sequence[str], clicks: bool) -> Batch:
    """Samples `chosen` of `data` as one batch of `features`; labels as clicks or
    classes. A sample that lacks a feature or whose dense features differ in number
    from the others' is a ValueError naming it."""
    return collate_samples([data.sample(i) for i in chosen], chosen, features, clicks)


def collate_samples(
    drawn: Sequence[Sample], chosen: list[int], features: Sequence[str], clicks: bool
) -> Batch:
    """`drawn`, the samples numbered `chosen`, as one batch (see `collate`)."""
    dense, labels = [], []
    ids: dict[str, list[int]] = {f: [] for f in features}
    lengths: dict[str, list[int]] = {f: [] for f in features}
    for i, (values, sparse, label) in zip(chosen, drawn, strict=True):
        missing = [f for f in features if f not in sparse]
        if missing:
            raise ValueError(
                f"sample {i} has no ids for feature(s) {', '.join(missing)} (it"
                f" has {', '.join(sparse) or 'none'}); every table's feature"
                " must be in every sample"
            )
        for f in features:
            ids[f].extend(sparse[f])
            lengths[f].append(len(sparse[f]))
        dense.append(list(values))
        labels.append(label)
    widths = {len(d) for d in dense}
    if len(widths) > 1:
        raise ValueError(
            f"samples {chosen[0]}..{chosen[-1]} have {sorted(widths)} dense"
            " features: every sample must have the same number"
        )
    as_long = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    real = torch.get_default_dtype()  # float32 unless a process chose float64
    return Batch(
        sample_ids=list(chosen),
        dense=torch.tensor(dense, dtype=real).reshape(len(chosen), widths.pop()),
        ids={f: as_long(v) for f, v in ids.items()},
        lengths={f: as_long(v) for f, v in lengths.items()},
        labels=torch.tensor(labels, dtype=real if clicks else torch.int64),
    )


def order(size: int, seed: int, epoch: int) -> list[int]:
    """Epoch `epoch`'s order of the samples 0..size-1: a function of (size, seed, epoch)."""
    indices = list(range(size))
    random.Random(f"pipejob-order:{seed}:{epoch}").shuffle(indices)
    return indices


def stream(
    data: Samples,
    batch: int,
    share: tuple[int, int],
    seed: int,
    features: Sequence[str],
    clicks: bool,
    start: int = 0,
) -> Iterator[Batch]:
    """Trainer k of T's share, `share` (k, T), of every step's batch, forever: the steps read
    the stream of epoch 0's order of the samples, then epoch 1's, ..., `batch` samples at a
    time from sample `start` of the stream on, and trainer k takes samples k*batch//T to
    (k+1)*batch//T - 1 of each (equal shares where T divides the batch). A step's batch is
    the same at any T, and no sample is read twice in one epoch."""
    reading = _Reading(batch, share, seed, features, clicks, start)
    if isinstance(data, ClickLogs):
        return _lanes(data, reading)
    if data.size < 1 or not 0 <= share[0] < share[1]:
        raise ValueError(f"cannot read share {share[0]} of {share[1]} of {data.size} samples")
    return _indexed(data, reading)


class _Reading(NamedTuple):
    """What a `stream` reads, as its arguments say."""

    batch: int
    share: tuple[int, int]
    seed: int
    features: Sequence[str]
    clicks: bool
    start: int


def _indexed(data: Samples, reading: _Reading) -> Iterator[Batch]:
    """`stream` of samples read by index (each epoch's order a shuffle of them all)."""
    batch, share, seed, features, clicks, start = reading
    rows = share_of(batch, *share)
    orders: dict[int, list[int]] = {}  # the epochs the last batch read
    for position in itertools.count(start, batch):
        places = [divmod(position + r, data.size) for r in rows]
        # Each epoch's order once: the share's samples span one epoch, or two at its end.
        orders = {
            e: orders[e] if e in orders else order(data.size, seed, e)
            for e in sorted({e for e, _ in places})
        }
        chosen = collate(data, [orders[e][i] for e, i in places], features, clicks)
        yield dataclasses.replace(chosen, epochs=[e for e, _ in places])


def _lanes(logs: ClickLogs, reading: _Reading) -> Iterator[Batch]:
    """`stream` of click logs: a step's batch is batch/lanes lines of every lane, trainer k
    of T reading lanes share_of(lanes, k, T) (clicklogs.py)."""
    batch, share, seed, features, clicks, start = reading
    lanes = logs.lanes
    mine = share_of(lanes, *share)
    if batch % lanes or start % lanes or not mine:
        raise ValueError(
            f"cannot read share {share[0]} of {share[1]} of {lanes} lanes"
            f" (trainers.max) in batches of {batch} from sample {start}"
        )
    per = batch // lanes
    readers = [logs.read(lane, seed, start // lanes) for lane in mine]
    while True:
        rows = [row for reader in readers for row in itertools.islice(reader, per)]
        made = _click_batch(logs, [(i, line) for _, i, line in rows], features, clicks)
        yield dataclasses.replace(made, epochs=[epoch for epoch, _, _ in rows])


def _click_batch(
    logs: ClickLogs, lines: list[tuple[int, bytes]], features: Sequence[str], clicks: bool
) -> Batch:
    """Lines (id, line) of click logs as one batch, parsed all at once (criteo.parse_many);
    a bad line is read alone, which names it."""
    ids = [line_id for line_id, _ in lines]
    parsed = criteo.parse_many([line for _, line in lines])
    if parsed is None:
        drawn = [logs.parse(line_id, line) for line_id, line in lines]
        return collate_samples(drawn, ids, features, clicks)
    dense, categorical, labels = parsed
    column = {f: k for k, f in enumerate(criteo.FEATURES)}
    real = torch.get_default_dtype()
    ones = torch.ones(len(lines), dtype=torch.int64)
    return Batch(
        sample_ids=ids,
        dense=torch.from_numpy(dense).to(real),
        ids={f: torch.from_numpy(categorical[:, column[f]].copy()) for f in features},
        lengths={f: ones for f in features},
        labels=torch.from_numpy(labels).to(real if clicks else torch.int64),
    )


def first(data: Samples | ClickLogs) -> Sample:
    """The data's first sample (its dense features' count sizes the dense model)."""
    return data.first if isinstance(data, ClickLogs) else data.sample(0)


def in_order(
    data: Samples, batch_size: int, features: Sequence[str], clicks: bool, limit: int = 0
) -> list[Batch]:
    """`data` in order as batches of `batch_size` (the last may be smaller); only the first
    `limit` batches when it is not 0. For evaluation: every sample once, no cycling."""
    if isinstance(data, ClickLogs):
        rows = data.lines_in_order()
        chunks = iter(lambda: list(itertools.islice(rows, batch_size)), [])
        return [
            _click_batch(data, chunk, features, clicks)
            for chunk in itertools.islice(chunks, limit or None)
        ]
    count = -(-data.size // batch_size)
    count = min(count, limit) if limit else count
    return [
        collate(
            data,
            list(range(b * batch_size, min((b + 1) * batch_size, data.size))),
            features,
            clicks,
        )
        for b in range(count)
    ]


def split_samples(spec: HybridSpec, split: str) -> Samples | None:
    """The `split` ("train" or "val") of the spec's data source; None when it has no
    held-out set. Synthetic samples (the default) hold out `held_out_size` samples drawn
    with another seed."""
    d = spec.data
    # A feature's ids must lie below the rows of every table it feeds.
    rows = {
        f: min(t.rows for t in spec.embeddings if t.feature == f)
        for f in {t.feature for t in spec.embeddings}
    }
    if d.file is not None:
        path = d.file.train if split == "train" else d.file.val
        field = f"spec.data.file.{split}"
        return None if path is None else OneFeature(FileBags(path, field, rows[BAGS]), BAGS)
    if d.criteo is not None:
        path = d.criteo.train if split == "train" else d.criteo.val
        lanes = spec.trainers.max if split == "train" else 1
        field = f"spec.data.criteo.{split}"
        return None if path is None else ClickLogs(path, field, lanes)  # type: ignore[return-value]
    if d.import_ is not None:
        field = "spec.data.import"
        dataset = imports.call(d.import_, field, d.args, split=split)
        if dataset is None:
            return None
        if spec.recommends:
            return ImportedClicks(dataset, field, split, rows)
        return OneFeature(ImportedBags(dataset, field, split, rows[BAGS]), BAGS)
    size = spec.dataset_size if split == "train" else held_out_size(spec)
    # Seeds are >= 0: -1 - seed is a stream no training set is drawn from.
    seed = spec.seed if split == "train" else -1 - spec.seed
    if spec.recommends:
        return SyntheticClicks(
            size=size,
            features=tuple(sorted(rows.items())),
            dense_features=spec.dense_features,
            bag_size=spec.bag_size,
            seed=seed,
        )
    bags = SyntheticBags(
        size=size,
        num_embeddings=rows[BAGS],
        classes=spec.dense.out_features,
        bag_size=spec.bag_size,
        seed=seed,
    )
    return OneFeature(bags, BAGS)
