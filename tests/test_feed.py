"""A PipelineJob's data (workloads/data.py) on real data written by tests/userdata.py: the
sources' batches, the seeded order and its resume, the held-out sets, and the errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from userdata import BYTE_VOCAB, write_digits, write_stdlib_tokens

from pipejob.core.common_spec import Optimizer, Preflight
from pipejob.core.data_sources import PipelineData, Split, Tokens
from pipejob.core.elastic import Size
from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.core.workload import Model, Transformer
from pipejob.trainer.workloads import data, sources
from pipejob.trainer.workloads.data import DataError, Feed, StreamSampler, held_out, sample, task
from pipejob.trainer.workloads.synthetic import SyntheticImages

pytestmark = pytest.mark.timeout(120)

MEAN = torch.tensor(sources.IMAGENET_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(sources.IMAGENET_STD).view(1, 3, 1, 1)
SEQ = 64


def make_spec(**fields: Any) -> PipelineSpec:
    base: dict[str, Any] = dict(
        steps=10,
        seed=0,
        log_every=1,
        rendezvous_timeout_seconds=60,
        optimizer=Optimizer(name="sgd", lr=0.1, momentum=0.0, weight_decay=0.0),
        preflight=Preflight(enabled=False, timeout_seconds=10, megabytes=1.0),
        model=Model(torchvision="resnet18"),
        stages=2,
        replicas=Size.parse(1),
        micro_batches=2,
        batch_size=8,
        image_size=16,
        num_classes=10,
        gpus_per_stage=0,
    )
    if isinstance(fields.get("replicas"), int):
        fields["replicas"] = Size.parse(fields["replicas"])
    return PipelineSpec(**(base | fields))


def transformer(vocab: int = BYTE_VOCAB) -> Model:
    return Model(
        transformer=Transformer(vocab_size=vocab, layers=2, width=32, heads=2, seq_len=SEQ)
    )


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_digits(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tokens")
    write_stdlib_tokens(root / "train.bin", max_bytes=300_000)
    write_stdlib_tokens(root / "val.bin", max_bytes=20_000, split="val")
    return root / "train.bin", root / "val.bin"


def folder_spec(digits: tuple[Path, Path | None], **fields: Any) -> PipelineSpec:
    train, val = digits
    source = PipelineData(
        image_folder=Split(train=str(train), val=val and str(val)), workers=fields.pop("workers", 0)
    )
    return make_spec(data=source, **fields)


def token_spec(tokens: tuple[Path, Path], **fields: Any) -> PipelineSpec:
    train, val = tokens
    source = PipelineData(
        tokens=Tokens(train=str(train), val=str(val), dtype="uint16"),
        workers=fields.pop("workers", 0),
    )
    return make_spec(model=fields.pop("model", transformer()), data=source, **fields)


# ---------------------------------------------------------------------------- a tiny import


class Squares(torch.utils.data.Dataset):
    """Sample i is (tensor [i, i*i], i % 3): its input says which sample it is."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(i), float(i * i)]), i % 3


def squares(split: str, size: int = 21) -> Squares | None:
    return Squares(size) if split == "train" else None


def not_a_dataset(split: str) -> Any:
    return 42


def empty(split: str) -> Any:
    return []


def import_spec(path: str = "test_feed:squares", workers: int = 0, **fields: Any) -> PipelineSpec:
    source = PipelineData(import_=path, args=fields.pop("args", {}), workers=workers)
    return make_spec(data=source, **fields)


# ---------------------------------------------------------------------------- synthetic


def test_synthetic_images_are_today_s_stream_and_resume() -> None:
    spec = make_spec(seed=7, batch_size=4, replicas=2, image_size=32, num_classes=5)
    before = SyntheticImages(7, 8, 32, 5)  # what the master made before this module
    feed = Feed(spec)
    assert feed.description == "synthetic 32x32 images, 5 classes"
    for _ in range(3):
        (x, y), (x0, y0) = feed.batch(), before.batch()
        assert torch.equal(x, x0) and torch.equal(y, y0)
    state = feed.state()
    expected = [before.batch() for _ in range(2)]
    for saved in (state, state["generator"]):  # a bare generator state: older checkpoints
        resumed = Feed(spec)
        resumed.load_state(saved)
        for x0, y0 in expected:
            x, y = resumed.batch()
            assert torch.equal(x, x0) and torch.equal(y, y0)
    x, y = sample(spec, 3)
    assert x.shape == (3, 3, 32, 32) and y.shape == (3,)
    assert task(spec) == "classification"


def test_a_replica_draws_its_share_of_each_synthetic_batch_alone() -> None:
    """Each image is drawn from its own seed, on several threads: a replica's feed draws
    only its rows, and they are the whole batch's rows, batch after batch."""
    spec = make_spec(seed=5, batch_size=3, replicas=2, image_size=16, num_classes=4)
    whole, parts = Feed(spec), [Feed(spec, r, 2) for r in range(2)]
    for _ in range(3):
        x, y = whole.batch()
        (x0, y0), (x1, y1) = (p.batch() for p in parts)
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        assert len(x0) == 3 and not torch.equal(x0, x1)


def test_synthetic_held_out_is_the_same_task_on_other_images() -> None:
    spec = make_spec(seed=3, batch_size=4, image_size=16, num_classes=4)
    held = held_out(spec)
    assert held is not None
    first, again = list(held.batches(0)), list(held.batches(0))
    assert len(first) == data.SYNTHETIC_HELD_OUT_BATCHES and len(list(held.batches(2))) == 2
    for (x, y), (x0, y0) in zip(first, again, strict=True):
        assert torch.equal(x, x0) and torch.equal(y, y0)
    train = SyntheticImages(3, 4, 16, 4)
    assert not torch.equal(first[0][0], train.batch()[0]), "held-out images are training images"
    # Same task: each class's mean colour over many held-out images is its training colour.
    x = torch.cat([b[0] for b in first]).mean(dim=(2, 3))
    y = torch.cat([b[1] for b in first])
    for c in y.unique():
        assert torch.allclose(x[y == c].mean(0), train.colours[c].flatten(), atol=0.1)


def test_synthetic_tokens_follow_a_learnable_rule() -> None:
    spec = make_spec(model=transformer(vocab=97), batch_size=4, replicas=2, seed=5)
    assert task(spec) == "language"
    feed = Feed(spec)
    x, y = feed.batch()
    assert x.shape == y.shape == (8, SEQ) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    rule = feed.stream.successor  # the same successor of a token everywhere: learnable
    assert torch.equal(rule[x], y)
    assert len(x[:, 0].unique()) > 1, "every window starts at the same token"
    state = feed.state()
    after = [feed.batch() for _ in range(2)]
    resumed = Feed(spec)
    resumed.load_state(state)
    assert all(torch.equal(resumed.batch()[0], a[0]) for a in after)
    held = held_out(spec)
    assert held is not None
    hx, hy = next(held.batches(1))
    assert torch.equal(rule[hx], hy), "the held-out windows follow another rule"
    assert not torch.equal(hx, x)


# ---------------------------------------------------------------------------- the order


@pytest.mark.parametrize("size,batch", [(21, 8), (10, 10), (7, 16), (100, 3)])
def test_the_stream_is_seeded_permutations_in_batches(size: int, batch: int) -> None:
    n = 3 * size // batch + 3  # batches enough for three epochs

    def first(sampler: StreamSampler, count: int = n) -> list[list[int]]:
        return [b for b, _ in zip(sampler, range(count), strict=False)]

    batches = first(StreamSampler(size, batch, seed=11))
    assert batches == first(StreamSampler(size, batch, seed=11))
    assert all(len(b) == batch for b in batches)
    flat = [i for b in batches for i in b]
    epochs = [flat[e * size : (e + 1) * size] for e in range(len(flat) // size)]
    assert len(epochs) >= 3
    assert all(sorted(e) == list(range(size)) for e in epochs), "an index missed or repeated"
    assert len({tuple(e) for e in epochs}) > 1, "every epoch has the same order"
    assert flat[:size] != list(range(size))
    assert first(StreamSampler(size, batch, seed=12)) != batches
    assert first(StreamSampler(size, batch, seed=11, start=5 * batch), n - 5) == batches[5:]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_feed_sees_exactly_what_an_uninterrupted_one_sees(workers: int) -> None:
    spec = import_spec(workers=workers, batch_size=4, replicas=2)  # 21 samples, batches of 8
    whole = Feed(spec)
    stream = []
    for _ in range(9):  # more than three epochs, batches across their boundaries
        x, _ = whole.batch()
        assert whole.last_indices == x[:, 0].long().tolist()
        stream.append(whole.last_indices)
    whole.close()
    first = Feed(spec)
    seen = []
    for _ in range(4):
        first.batch()
        seen.append(first.last_indices)
    state = first.state()
    first.close()
    resumed = Feed(spec)
    resumed.load_state(state)
    for _ in range(5):
        x, y = resumed.batch()
        seen.append(resumed.last_indices)
        assert torch.equal(x[:, 0].long(), torch.tensor(seen[-1]))
        assert torch.equal(y, torch.tensor(seen[-1]) % 3)
    resumed.close()
    assert seen == stream
    flat = [i for b in stream for i in b]
    assert sorted(flat[:21]) == sorted(flat[21:42]) == list(range(21))


def test_a_resumed_image_folder_feed_with_workers(digits: tuple[Path, Path]) -> None:
    spec = folder_spec(digits, workers=2, batch_size=16, image_size=8)
    with Feed(spec) as whole:
        expected = [whole.batch() for _ in range(5)]
        indices = whole.last_indices
    with Feed(spec) as first:
        first.batch(), first.batch()
        state = first.state()
    with Feed(spec) as resumed:
        resumed.load_state(state)
        got = [resumed.batch() for _ in range(3)]
        assert resumed.last_indices == indices
    for (x, y), (x0, y0) in zip(got, expected[2:], strict=True):
        assert torch.equal(x, x0) and torch.equal(y, y0)


def test_a_checkpoint_of_other_data_is_refused() -> None:
    feed = Feed(import_spec())
    feed.batch()
    with pytest.raises(DataError, match="held 21 samples.*now holds 30"):
        Feed(import_spec(args={"size": 30})).load_state(feed.state())
    with pytest.raises(DataError, match="spec.data changed"):
        Feed(make_spec()).load_state(feed.state())


# ---------------------------------------------------------------------------- the sources


def test_image_folder_batches(digits: tuple[Path, Path]) -> None:
    from sklearn.datasets import load_digits

    spec = folder_spec(digits, batch_size=12, replicas=2, image_size=8)  # the PNGs' own size
    feed = Feed(spec)
    train_count = sum(1 for _ in digits[0].rglob("*.png"))
    assert feed.description == f"imageFolder {digits[0]}: {train_count:,} images, 10 classes"
    x, y = feed.batch()
    assert x.shape == (24, 3, 8, 8) and x.dtype == torch.float32
    assert y.shape == (24,) and y.dtype == torch.int64
    pixels = x * STD + MEAN  # ImageNet normalisation undone: [0, 1], grey (equal channels)
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5
    assert torch.allclose(pixels[:, 0], pixels[:, 1], atol=1e-5)
    originals = load_digits()
    for row, i in enumerate(feed.last_indices):
        path, label = feed.dataset.samples[i]
        assert Path(path).parent.name == str(label) == str(y[row].item())
        digit = int(Path(path).stem)
        assert originals.target[digit] == label
        original = np.rint(originals.images[digit] * (255 / 16)) / 255
        assert torch.allclose(
            pixels[row, 0], torch.tensor(original, dtype=torch.float32), atol=1e-5
        )
    assert task(spec) == "classification"
    bigger = Feed(folder_spec(digits, batch_size=4, image_size=32)).batch()[0]
    assert bigger.shape == (4, 3, 32, 32)


def test_image_folder_held_out_is_the_whole_val_split_in_a_fixed_order(
    digits: tuple[Path, Path],
) -> None:
    spec = folder_spec(digits, batch_size=50, replicas=2, image_size=8, workers=1)
    held = held_out(spec)
    assert held is not None
    val_count = sum(1 for _ in digits[1].rglob("*.png"))
    assert held.description == f"imageFolder {digits[1]}: {val_count:,} images, 10 classes"
    sizes = [len(y) for _, y in held.batches(0)]
    assert sum(sizes) == val_count and sizes[:-1] == [100] * (len(sizes) - 1)
    two = list(held.batches(2))
    assert len(two) == 2
    again = held.batches(2)
    next(again)  # an evaluation cut short: the next one still starts at the first batch
    three = list(held.batches(2))
    for (x, y), (x0, y0) in zip(three, two, strict=True):
        assert torch.equal(x, x0) and torch.equal(y, y0)
    held.close()


def test_sample_is_the_first_of_the_training_order(digits: tuple[Path, Path]) -> None:
    spec = folder_spec(digits, batch_size=6, image_size=8)
    x, y = sample(spec, 6)
    x0, y0 = Feed(spec).batch()
    assert torch.equal(x, x0) and torch.equal(y, y0)


def test_token_windows(tokens: tuple[Path, Path]) -> None:
    spec = token_spec(tokens, batch_size=5, replicas=2)
    on_disk = np.fromfile(tokens[0], dtype=np.uint16)
    feed = Feed(spec)
    windows = (len(on_disk) - 1) // SEQ
    assert feed.description == (
        f"tokens {tokens[0]}: {len(on_disk):,} uint16 tokens, {windows:,} windows of {SEQ + 1}"
    )
    assert len(feed.dataset) == windows
    x, y = feed.batch()
    assert x.shape == y.shape == (10, SEQ) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, i in enumerate(feed.last_indices):
        window = torch.from_numpy(on_disk[i * SEQ : i * SEQ + SEQ + 1].astype(np.int64))
        assert torch.equal(x[row], window[:-1]) and torch.equal(y[row], window[1:])
    last = feed.dataset[windows - 1]  # the last whole window ends inside the file
    assert torch.equal(
        last[1][-1:], torch.tensor(on_disk[windows * SEQ : windows * SEQ + 1], dtype=torch.int64)
    )
    assert task(spec) == "language"
    held = held_out(spec)
    assert held is not None and "tokens " + str(tokens[1]) in held.description
    assert sum(len(b[0]) for b in held.batches(0)) == (20_000 - 1) // SEQ


def test_import_source_and_its_held_out() -> None:
    spec = import_spec(batch_size=5)
    feed = Feed(spec)
    assert feed.description == "import test_feed:squares (train): 21 samples"
    x, y = feed.batch()
    assert x.shape == (5, 2) and torch.equal(x[:, 1], x[:, 0] ** 2) and y.dtype == torch.int64
    assert held_out(spec) is None, "split='val' returned None: no held-out set"


# ---------------------------------------------------------------------------- errors


def test_image_folder_errors_name_the_field(digits: tuple[Path, Path], tmp_path: Path) -> None:
    missing = folder_spec((tmp_path / "nowhere", digits[1]))
    with pytest.raises(DataError, match=r"spec\.data\.imageFolder\.train: .*nowhere.* not a dir"):
        Feed(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"spec\.data\.imageFolder\.train: .*find any class folder"):
        Feed(folder_spec((tmp_path / "empty", digits[1])))
    (tmp_path / "classless" / "0").mkdir(parents=True)
    with pytest.raises(DataError, match=r"spec\.data\.imageFolder\.train: .*classless"):
        Feed(folder_spec((tmp_path / "classless", None)))  # a class folder with no images
    fewer = tmp_path / "fewer"
    for digit in range(9):
        (fewer / str(digit)).mkdir(parents=True)
    with pytest.raises(DataError, match=r"spec\.data\.imageFolder\.val: .*only in train: \['9'\]"):
        Feed(folder_spec((digits[0], fewer)))
    spec = folder_spec((digits[0], tmp_path / "no-val"))
    with pytest.raises(DataError, match=r"spec\.data\.imageFolder\.val: .*not a directory"):
        held_out(spec)


def test_token_errors_name_the_field(tmp_path: Path) -> None:
    def spec(path: Path, model: Model | None = None) -> PipelineSpec:
        return token_spec((path, path), model=model or transformer())

    with pytest.raises(DataError, match=r"spec\.data\.tokens\.train: .*not a file"):
        Feed(spec(tmp_path / "missing.bin"))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(DataError, match=r"spec\.data\.tokens\.train: .*3 bytes, not a multiple"):
        Feed(spec(odd))
    short = tmp_path / "short.bin"
    np.arange(SEQ, dtype=np.uint16).tofile(short)
    with pytest.raises(DataError, match=r"spec\.data\.tokens\.train: .*64 tokens, fewer than"):
        Feed(spec(short))
    large = tmp_path / "large.bin"
    np.array([1, 2, 300] * 100, dtype=np.uint16).tofile(large)
    with pytest.raises(
        DataError,
        match=r"spec\.data\.tokens\.train: .*token id 300, outside"
        r" spec\.model\.transformer\.vocabSize 256",
    ):
        Feed(spec(large))
    with pytest.raises(DataError, match=r"spec\.data\.tokens\.seqLen is required"):
        Feed(spec(large, Model(import_="userpkg.brought:gpt2")))
    wrong = dataclasses.replace(spec(large).data.tokens, dtype="int8")
    with pytest.raises(DataError, match=r"spec\.data\.tokens\.dtype: 'int8'"):
        Feed(make_spec(model=transformer(), data=PipelineData(tokens=wrong)))


@pytest.mark.parametrize(
    "path,message",
    [
        ("test_feed:not_a_dataset", r"returned 'int', not a map-style Dataset"),
        ("test_feed:empty", r"returned an empty dataset"),
        ("test_feed:Squares", r"raised TypeError"),  # a factory its arguments do not fit
        ("test_feed:nothing", r"has no 'nothing'"),
    ],
)
def test_import_errors_name_the_field(path: str, message: str) -> None:
    with pytest.raises((ValueError, ImportError), match=r"spec\.data\.import: .*" + message):
        Feed(import_spec(path))


def test_the_feed_leaves_the_global_rng_alone() -> None:
    """The master's seeded RNG state (what a checkpoint keeps) must not depend on the data."""
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with Feed(import_spec(workers=2)) as feed:
        feed.batch(), feed.batch()
    assert torch.equal(before, torch.get_rng_state())


# ---------------------------------------------------------------------------- replica shares


@pytest.mark.parametrize("which", ["synthetic", "import", "tokens"])
def test_each_replica_s_feed_reads_its_share_of_the_whole_batch(which: str, tokens) -> None:
    """The first stage of replica r reads samples r*B .. (r+1)*B-1 of each step's batch:
    together the replicas read exactly the whole batch, in order, and their positions (what a
    checkpoint keeps) are the whole feed's."""
    spec = {
        "synthetic": make_spec(batch_size=3, replicas=2, image_size=8),
        "import": import_spec(workers=2, batch_size=3, replicas=2),
        "tokens": token_spec(tokens, batch_size=3, replicas=2),
    }[which]
    with Feed(spec) as whole, Feed(spec, 0) as first, Feed(spec, 1) as second:
        for _ in range(9):  # beyond an epoch of the 21 squares
            x, y = whole.batch()
            (x0, y0), (x1, y1) = first.batch(), second.batch()
            assert x0.shape[0] == x1.shape[0] == 3
            assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        assert first.state().keys() == whole.state().keys()
        assert first.state()["samples"] == second.state()["samples"] == whole.state()["samples"]
