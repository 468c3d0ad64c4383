"""A PipelineJob's data: the training batches step by step (`Feed`), the held-out set
(`held_out`), a first batch to measure the model with (`sample`) and the kind of task
(`task`), from the one source `spec.data` names. Step k's batch is a fixed slice of a
stream of per-epoch permutations of (seed, epoch), so a run resumes on exactly its samples
at any replica count. How: docs/architecture.md, "The data's order"."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, TypedDict

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.workloads import sources
from pipejob.trainer.workloads.sources import DataError
from pipejob.trainer.workloads.synthetic import (
    SyntheticImages,
    SyntheticTokens,
    held_out_images,
    share_of,
)

Batch = tuple[torch.Tensor, torch.Tensor]
HELD_OUT_OFFSET = 1_000_003  # the synthetic held-out stream's seed is seed + this
SYNTHETIC_HELD_OUT_BATCHES = 10  # a synthetic held-out set has no end: this many when limit 0


def task(spec: PipelineSpec) -> str:
    """The task: "language" (labels (B, seqLen) of token ids, metric perplexity) or "classification"
    (labels (B,) of class ids, metric accuracy)."""
    language = spec.model.transformer is not None or spec.data.tokens is not None
    return "language" if language else "classification"


# ---------------------------------------------------------------------------- the order


class StreamSampler(Sampler[list[int]]):
    """Batches of B indices of a dataset of `size`, from sample `start` of the stream on,
    forever: the global stream is epoch 0's permutation, then epoch 1's, ...; a batch may span
    two epochs. With `share` (r, R), only the r-th of R parts of each batch (a replica's, see
    synthetic.share_of)."""

    def __init__(
        self, size: int, batch: int, seed: int, start: int = 0, share: tuple[int, int] = (0, 1)
    ):
        self.size, self.batch, self.seed, self.start = size, batch, seed, start
        self.share = share
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s order, a function of (seed, epoch) only."""
        if epoch != self._epoch:  # SeedSequence mixes the two: no (seed, epoch) pair collides
            rng = np.random.default_rng([self.seed % 2**64, epoch])
            self._epoch, self._order = epoch, rng.permutation(self.size)
        return self._order

    def take(self, position: int, count: int) -> list[int]:
        """stream[position : position + count]."""
        out: list[int] = []
        while len(out) < count:
            epoch, offset = divmod(position + len(out), self.size)
            out.extend(self.permutation(epoch)[offset : offset + count - len(out)].tolist())
        return out

    def __iter__(self) -> Iterator[list[int]]:
        rows = share_of(self.batch, *self.share)
        for k in itertools.count():
            yield self.take(self.start + k * self.batch + rows.start, len(rows))


class _Indexed(Dataset):
    """The dataset's sample i as (i, input, label), so a batch says which samples it holds."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[int, Any, Any]:
        x, y = self.dataset[i]
        return i, x, y


def _loader(dataset: Any, batches: Any, workers: int, seed: int) -> DataLoader:
    return DataLoader(
        _Indexed(dataset),
        batch_sampler=batches,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
        # Its own generator: making an iterator then never draws from the global RNG (the
        # master's seeded state), and workers' seeds are the same in every run.
        generator=torch.Generator().manual_seed(seed),
    )


def _shutdown(iterator: Any) -> None:
    if hasattr(iterator, "_shutdown_workers"):  # not None, nor a single-process iterator
        iterator._shutdown_workers()


# ---------------------------------------------------------------------------- the training feed


class FeedState(TypedDict, total=False):
    """A feed's position as a checkpoint keeps it (`Feed.state`): the samples read, the
    batch and data it read them in, and a synthetic stream's generator or a dataset's size.
    Older checkpoints: a count of `batches` instead of samples."""

    samples: int
    batchSize: int
    description: str
    generator: torch.Tensor
    size: int
    batches: int


class Feed:
    """The training batches of a PipelineJob, step by step, in a seeded order whose position a
    checkpoint keeps. Each batch is a step's whole batch (batchSize x replicas.max samples: the
    same at every size an elastic world runs at), or with `replica` r only replica r's share
    of it, among `replicas` (the world's; default replicas.max): the first stage of each
    replica reads its own (pipeline/reader.py)."""

    def __init__(self, spec: PipelineSpec, replica: int | None = None, replicas: int | None = None):
        self.spec = spec
        self.batch_size = spec.batch_size * spec.replicas.max  # a step's whole batch
        # Which part of each batch this feed gives: (r, R), the r-th of R parts.
        self.share = (0, 1) if replica is None else (replica, replicas or spec.replicas.max)
        self.samples = 0  # of the stream consumed so far: the position a checkpoint keeps
        self.last_indices: list[int] = []  # the sample indices of the last batch (map-style)
        self._iterator: Any = None
        self.stream: SyntheticImages | SyntheticTokens | None = _synthetic(spec, self.batch_size)
        if self.stream is not None:
            self.dataset: Any = None
            self.description = _synthetic_description(spec)
        else:
            self.dataset, self.description = sources.dataset(spec, "train")

    def batch(self) -> Batch:
        """The next step's (inputs, labels): the whole batch, or this replica's share."""
        if self.stream is not None:
            self.samples += self.batch_size
            if self.share[1] == 1:
                return self.stream.batch()
            rows = share_of(self.batch_size, *self.share)
            if isinstance(self.stream, SyntheticImages):  # draws this share's images alone
                return self.stream.batch(rows)
            inputs, labels = self.stream.batch()
            part = slice(rows.start, rows.stop)
            return inputs[part].clone(), labels[part].clone()  # not the whole batch's storage
        if self._iterator is None:
            sampler = StreamSampler(
                len(self.dataset),
                self.batch_size,
                self.spec.seed,
                start=self.samples,
                share=self.share,
            )
            loader = _loader(self.dataset, sampler, self.spec.data.workers, self.spec.seed)
            self._iterator = iter(loader)
        indices, inputs, labels = next(self._iterator)
        self.samples += self.batch_size
        self.last_indices = indices.tolist()
        return inputs, labels

    def sample(self, batch: int) -> Batch:
        """`batch` training samples, the first of the training order (synthetic: a stream
        of batches of `batch`), to measure the model's cost and check shapes before the
        first step. The feed's own position is left as it is."""
        stream = _synthetic(self.spec, batch)
        if stream is not None:
            return stream.batch()
        indices = StreamSampler(len(self.dataset), batch, self.spec.seed).take(0, batch)
        _, inputs, labels = default_collate([_Indexed(self.dataset)[i] for i in indices])
        return inputs, labels

    def state(self) -> FeedState:
        """What a checkpoint keeps: the position, and a synthetic stream's generator."""
        state = FeedState(
            samples=self.samples, batchSize=self.batch_size, description=self.description
        )
        if self.stream is not None:
            state["generator"] = self.stream.generator.get_state()
        else:
            state["size"] = len(self.dataset)
        return state

    def load_state(self, state: FeedState | torch.Tensor) -> None:
        """Continue exactly after the saved position, whatever batch the feed that saved it
        read: a map-style dataset's stream goes on from the saved sample; a synthetic stream
        from its generator (drawn in batches of another size it draws other samples, but
        never the same ones again). A bare generator state (what checkpoints held before this
        module) is taken for a synthetic stream's, and a count of batches (before the count
        of samples) for batches of this feed's size."""
        if isinstance(state, torch.Tensor):
            state = FeedState(generator=state, batches=0)
        if (self.stream is None) != ("generator" not in state):
            raise DataError(
                f"the checkpoint's data was {state.get('description', 'synthetic')!r},"
                f" this job's is {self.description!r}: spec.data changed"
            )
        if self.stream is not None:
            self.stream.generator.set_state(state["generator"])
        elif state["size"] != len(self.dataset):
            raise DataError(
                f"the checkpoint's data held {state['size']} samples, spec.data now"
                f" holds {len(self.dataset)} ({self.description}): resuming would"
                " repeat or skip samples"
            )
        self.samples = int(state.get("samples", state.get("batches", 0) * self.batch_size))
        self.close()  # the next batch restarts the stream at the saved position

    def close(self) -> None:
        """Stop the DataLoader's workers (the next batch would start them again)."""
        _shutdown(self._iterator)
        self._iterator = None

    def __enter__(self) -> Feed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- held out


class HeldOut:
    """The held-out set: the same batches, in the same order, at every evaluation."""

    def __init__(self, spec: PipelineSpec, dataset: Any, description: str):
        self.spec, self.dataset, self.description = spec, dataset, description
        self.batch_size = spec.batch_size * spec.replicas.max
        self._loaders: dict[int, DataLoader] = {}  # by limit; persistent workers serve each run

    def batches(self, limit: int) -> Iterator[Batch]:
        """Batches of batchSize x replicas.max (the last may be smaller): the whole set when
        `limit` is 0, else the first `limit` batches."""
        if self.dataset is None:  # synthetic: a fresh copy of the same stream each time
            stream = _synthetic(self.spec, self.batch_size, held_out=True)
            assert stream is not None
            for _ in range(limit or SYNTHETIC_HELD_OUT_BATCHES):
                yield stream.batch()
            return
        if limit not in self._loaders:
            size = len(self.dataset)
            chunks = [
                list(range(i, min(i + self.batch_size, size)))
                for i in range(0, size, self.batch_size)
            ]
            chunks = chunks[:limit] if limit else chunks
            workers = min(self.spec.data.workers, len(chunks))
            self._loaders[limit] = _loader(self.dataset, chunks, workers, self.spec.seed)
        # A persistent iterator restarts at the first batch, also after a partial evaluation.
        for _, inputs, labels in self._loaders[limit]:
            yield inputs, labels

    def close(self) -> None:
        for loader in self._loaders.values():
            _shutdown(getattr(loader, "_iterator", None))
        self._loaders.clear()


def held_out(spec: PipelineSpec) -> HeldOut | None:
    """The held-out set, or None when the data has none (no `val`, or an import whose factory
    returns None for split="val")."""
    if _is_synthetic(spec):
        return HeldOut(spec, None, "held-out " + _synthetic_description(spec))
    found = sources.dataset(spec, "val")
    return None if found is None else HeldOut(spec, *found)


def sample(spec: PipelineSpec, batch: int) -> Batch:
    """`Feed.sample` of a feed of its own."""
    with Feed(spec) as feed:
        return feed.sample(batch)


# ---------------------------------------------------------------------------- the sources


def _is_synthetic(spec: PipelineSpec) -> bool:
    return spec.data.image_folder is None and spec.data.tokens is None and not spec.data.import_


def _synthetic(spec: PipelineSpec, batch: int, held_out: bool = False) -> Any:
    """The synthetic stream (SyntheticImages or SyntheticTokens) the spec asks for, None when
    it names a data source. The held-out stream shares the task (the classes' colours, the
    token rule) and draws other samples (seed + HELD_OUT_OFFSET)."""
    if not _is_synthetic(spec):
        return None
    seed = spec.seed + HELD_OUT_OFFSET if held_out else spec.seed
    t = spec.model.transformer
    if t is not None:
        return SyntheticTokens(seed, batch, t.seq_len, t.vocab_size, rule_seed=spec.seed)
    if held_out:
        return held_out_images(spec.seed, batch, spec.image_size, spec.num_classes)
    return SyntheticImages(seed, batch, spec.image_size, spec.num_classes)  # as before this module


def _synthetic_description(spec: PipelineSpec) -> str:
    t = spec.model.transformer
    if t is not None:
        return (
            f"synthetic tokens: vocabulary {t.vocab_size:,}, windows of {t.seq_len + 1}"
            " following a seeded rule t[i+1] = (a*t[i] + b) mod vocabulary"
        )
    return f"synthetic {spec.image_size}x{spec.image_size} images, {spec.num_classes} classes"
