"""A HybridJob's data at any size: the stream's start-up does not grow with the batch or the
share, and click logs (plain or gzip, one file, a list or a glob) are streamed: each trainer
reads its own disjoint lanes in bounded memory, an epoch reads every line once, and a resumed
stream continues exactly."""

from __future__ import annotations

import gzip
import itertools
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import recsys_reference as reference
import torch
import torch.nn.functional as F
from test_hybrid import FLOAT64, hybrid_job

from jobrun import run_to_end
from pipejob.core import spec as specs
from pipejob.trainer.runtime import checkpoint
from pipejob.trainer.workloads import criteo, samples
from pipejob.trainer.workloads.clicklogs import ClickLogs

pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True)
class Numbered:
    """`size` samples, sample i holding its own number as its one id."""

    size: int

    def sample(self, i: int) -> samples.Sample:
        return (), {"f": [i]}, 0.0


@pytest.mark.parametrize(("batch", "share"), [(8, (0, 1)), (1024, (1, 2)), (4096, (3, 4))])
def test_each_epoch_s_order_is_computed_once_whatever_the_batch_and_share(
    monkeypatch: pytest.MonkeyPatch, batch: int, share: tuple[int, int]
) -> None:
    """The order of an epoch is a shuffle of the whole data: computed once per epoch, not
    once per sample of the share (which made start-up grow with the share times the data)."""
    computed: list[int] = []
    real = samples.order

    def counted(size: int, seed: int, epoch: int) -> list[int]:
        computed.append(epoch)
        return real(size, seed, epoch)

    monkeypatch.setattr(samples, "order", counted)
    data = Numbered(3000)
    reader = samples.stream(data, batch, share, 0, ["f"], True)
    epochs: set[int] = set()
    while len(epochs) < 3:
        epochs.update(next(reader).epochs)
    assert computed == sorted(epochs), computed  # each epoch once, in order


# ---------------------------------------------------------------------------- click logs

FEATURES = [f"C{i}" for i in range(1, 27)]


def log_lines(count: int, seed: int) -> list[bytes]:
    """`count` lines in Criteo's layout: empty fields, a negative I2, 8-hex-digit values."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        dense = ["" if rng.random() < 0.2 else str(rng.randrange(-3, 500)) for _ in range(13)]
        cats = ["" if rng.random() < 0.1 else f"{rng.getrandbits(32):08x}" for _ in range(26)]
        out.append("\t".join([str(int(rng.random() < 0.25)), *dense, *cats]).encode())
    return out


def write(path: Path, lines: list[bytes]) -> Path:
    """The lines as Criteo's files are: no newline after the last; gzip for a .gz name."""
    data = b"\n".join(lines)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def epoch_rows(logs: ClickLogs, lane: int, epoch: int = 0) -> list[tuple[int, int, bytes]]:
    reader = itertools.dropwhile(lambda row: row[0] < epoch, logs.read(lane, seed=7))
    return list(itertools.takewhile(lambda row: row[0] == epoch, reader))


def test_an_epoch_reads_every_line_once_across_the_lanes_of_plain_and_gzip_files(
    tmp_path: Path,
) -> None:
    """Three lanes over a glob of a plain file (cut at line ends into byte ranges) and two
    gzip ones: each lane reads its own pieces, and together they read every line once."""
    lines = log_lines(300, 0)
    write(tmp_path / "day_0.tsv", lines[:140])
    write(tmp_path / "day_1.gz", lines[140:250])
    write(tmp_path / "day_2.gz", lines[250:])
    logs = ClickLogs(
        str(tmp_path / "day_*"), "spec.data.criteo.train", lanes=3, chunk=2000, window=16
    )
    assert len(logs.chunks) > 3 and logs.files[0].endswith("day_0.tsv")
    for epoch in (0, 1):
        read = [row for lane in range(3) for row in epoch_rows(logs, lane, epoch)]
        counted = Counter(line for _, _, line in read)
        assert sorted(counted) == sorted(lines) and set(counted.values()) == {1}
        assert len({line_id for _, line_id, _ in read}) == 300
    lanes = [[line for _, _, line in epoch_rows(logs, lane)] for lane in range(3)]
    assert all(lanes) and lanes[0] != sorted(lanes[0])  # shuffled, every lane has lines


def test_one_gzip_file_is_shared_by_lanes_line_by_line(tmp_path: Path) -> None:
    lines = log_lines(50, 1)
    logs = ClickLogs(str(write(tmp_path / "day.gz", lines)), "train", lanes=2)
    read = [line for lane in (0, 1) for _, _, line in epoch_rows(logs, lane)]
    assert sorted(read) == sorted(lines)
    assert logs.parse(0, lines[0]) == logs.first  # a gzip file is read, not refused


def test_a_step_s_batch_is_the_same_at_any_trainer_count_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    """Lanes are trainers.max's: one trainer reads both lanes, two trainers one each, and a
    stream started at a position (samples consumed, here inside epoch 1) continues as the
    whole stream does, wherever the epochs end."""
    write(tmp_path / "a.tsv", log_lines(90, 2))
    write(tmp_path / "b.gz", log_lines(41, 3))
    logs = ClickLogs(
        f"{tmp_path / 'a.tsv'},{tmp_path / 'b.gz'}", "train", lanes=2, chunk=3000, window=8
    )
    batch, steps = 16, 14  # 14 x 16 = 224 samples: past epoch 0 of 131 lines
    whole = list(itertools.islice(samples.stream(logs, batch, (0, 1), 5, FEATURES, True), steps))
    assert max(max(b.epochs) for b in whole) >= 1
    halves = [samples.stream(logs, batch, (k, 2), 5, FEATURES, True) for k in (0, 1)]
    for b in whole:
        shares = [next(h) for h in halves]
        assert b.sample_ids == shares[0].sample_ids + shares[1].sample_ids
    for at in (3, 9, 12):
        resumed = samples.stream(logs, batch, (1, 2), 5, FEATURES, True, start=at * batch)
        for b in whole[at:]:
            got = next(resumed)
            assert got.sample_ids == b.sample_ids[batch // 2 :] and got.epochs == b.epochs[8:]
            assert got.dense.equal(b.dense[batch // 2 :])


@pytest.mark.parametrize("lines", [200, 1600])
def test_the_reader_holds_a_window_per_lane_whatever_the_logs_size(
    tmp_path: Path, lines: int
) -> None:
    """The bytes of lines a reader holds at once stay under a window per lane (plus a line),
    for logs 8 times larger as for small ones."""
    write(tmp_path / "day.tsv", log_lines(lines, 4))
    logs = ClickLogs(str(tmp_path / "day.tsv"), "train", lanes=2, chunk=4000, window_bytes=3000)
    reader = samples.stream(logs, 32, (0, 1), 0, FEATURES, True)
    for _ in range(2 * lines // 32):  # two epochs
        next(reader)
    longest = max(len(line) for line in log_lines(lines, 4))
    assert 3000 <= logs.most_held <= 2 * (3000 + longest)


def test_a_batch_parsed_at_once_is_the_lines_parsed_one_by_one(tmp_path: Path) -> None:
    lines = log_lines(64, 6)
    logs = ClickLogs(str(write(tmp_path / "day.tsv", lines)), "train")
    rows = list(enumerate(lines))
    fast = samples._click_batch(logs, rows, FEATURES[::5], True)
    slow = samples.collate_samples(
        [logs.parse(i, line) for i, line in rows], list(range(64)), FEATURES[::5], True
    )
    for name in ("dense", "labels"):
        assert getattr(fast, name).equal(getattr(slow, name)), name
    assert all(fast.ids[f].equal(slow.ids[f]) for f in FEATURES[::5])
    assert all(fast.lengths[f].equal(slow.lengths[f]) for f in FEATURES[::5])


@pytest.mark.parametrize(
    "odd",
    [
        None,  # numpy reads every field
        (2, b"-7"),  # a negative count
        (20, b"00AbCdEf"),  # upper and lower case hexadecimal
        (20, b"-1f"),  # a negative hexadecimal value
        (20, b"0x1f"),  # what int(x, 16) reads and numpy does not: Python reads the lines
        (3, b"+5"),
        (3, b" 5"),
        (20, b"1" * 16),  # over 15 hexadecimal digits: Python's ints
        (5, b"1" * 19),
    ],
)
def test_lines_parsed_by_numpy_are_the_lines_parsed_by_python_s_int(odd: Any) -> None:
    """criteo.parse_many reads digits with numpy; where it cannot, Python's int() reads the
    lines: either way every value is what Python's int() makes of each field, empty fields
    0 (the counts' log1p numpy's, as before, within a rounding of `parse`'s math.log1p)."""
    lines = log_lines(40, 7) + [b"1" + b"\t" * 39, b"0\t" + b"\t".join([b"3"] * 39) + b"\r"]
    if odd is not None:
        column, value = odd
        fields = lines[5].split(b"\t")
        fields[column] = value
        lines[5] = b"\t".join(fields)
    dense, categorical, labels = criteo.parse_many(lines)
    python = criteo._parse_many_in_python(lines)
    assert python is not None and all(
        a.tolist() == b.tolist() for a, b in zip(python, (dense, categorical, labels), strict=True)
    )
    for i, line in enumerate(lines):
        values, ids, label = criteo.parse(line.rstrip(b"\r"))
        assert dense[i].tolist() == pytest.approx(values, rel=1e-15) and labels[i] == label
        assert categorical[i].tolist() == [ids[f][0] for f in criteo.FEATURES]
    bad = lines[:3] + [lines[3].replace(b"\t", b"\tzz", 1)]
    assert criteo.parse_many(bad) is None  # `parse` says which line
    assert criteo.parse_many([lines[0], b"2" + lines[0][1:]]) is None  # a label of 2


def test_a_bad_line_names_its_file_line_and_column(tmp_path: Path) -> None:
    lines = log_lines(30, 5)
    columns = lines[21].split(b"\t")
    columns[2] = b"zz"  # I2
    lines[21] = b"\t".join(columns)
    path = write(tmp_path / "day.gz", lines)
    logs = ClickLogs(str(path), "spec.data.criteo.train", lanes=1)
    with pytest.raises(
        ValueError,
        match=rf"^spec.data.criteo.train: {path} line 22: I2 is 'zz',"
        " not an integer",
    ):
        list(itertools.islice(samples.stream(logs, 10, (0, 1), 0, FEATURES, True), 3))
    assert logs.where(0) == f"{path} line 1"
    with pytest.raises(ValueError, match="matches no file"):
        ClickLogs(str(tmp_path / "none_*.gz"), "spec.data.criteo.train")


def test_a_stream_s_batches_are_the_lines_as_dlrm_reads_them(tmp_path: Path) -> None:
    """Every batch two lanes read from a gzip log, with empty and negative fields, holds the
    values DLRM's preprocessing reads from the lines it names (an empty categorical field
    is id 0), as a reader written apart from pipejob's (recsys_reference) reads them."""
    lines = log_lines(96, 12)
    assert sum(line.count(b"\t\t") for line in lines) > 20  # many empty fields
    logs = ClickLogs(str(write(tmp_path / "day.gz", lines)), "train", lanes=2, window=16)
    by_id = dict(logs.lines_in_order())
    reader = samples.stream(logs, 32, (0, 1), 3, FEATURES, True)
    for _ in range(6):  # two epochs
        batch = next(reader)
        dense, ids, _, labels = reference.as_dlrm_reads([by_id[i] for i in batch.sample_ids])
        assert batch.dense.double().equal(dense.to(batch.dense.dtype).double())
        assert batch.labels.double().equal(labels)
        assert all(batch.ids[f].equal(ids[f]) for f in FEATURES)
        assert all(batch.lengths[f].eq(1).all() for f in FEATURES)


# ---------------------------------------------------------------------------- in a world

CLICKS = {
    "trainers": 2,
    "parameterServers": 2,
    "embeddings": [
        {"name": "C1", "rows": 3000, "dim": 4},  # split across both servers
        {"name": "C2", "rows": 40, "dim": 4, "mode": "mean"},
        {"name": "peak", "rows": 60, "dim": 4, "mode": "max", "feature": "C3"},
    ],
    "dense": {"dlrm": {"bottom": [8], "top": [8]}},
    "sparseOptimizer": {"name": "adagrad", "lr": 0.1},
    "optimizer": {"name": "sgd", "lr": 0.1},
    "batchSize": 8,
    "seed": 4,
    "rendezvousTimeoutSeconds": 60,
    "preflight": {"megabytes": 0.5},
}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_streamed_gzip_logs_train_and_resume_as_one_process_in_float64(tmp_path: Path) -> None:
    """Two trainers and two servers on a gzip log and a plain one (40 lines: a step reads 16,
    so step 3 crosses the epoch's end): stopped after step 2 (mid-epoch) and resumed from its
    checkpoint, the tables, their Adagrad state and the dense part after step 3 equal one
    process's after 3 steps on the same stream, to float64's rounding."""
    (tmp_path / "sitecustomize.py").write_text(FLOAT64)
    write(tmp_path / "day_0.gz", log_lines(25, 8))
    write(tmp_path / "day_1.tsv", log_lines(15, 9))
    data = {"criteo": {"train": str(tmp_path / "day_*")}}
    spec = CLICKS | {"data": data, "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 1}}
    for steps in (2, 3):  # the second run resumes from step 2's checkpoint
        code, output, _ = run_to_end(
            hybrid_job("clicks", spec | {"steps": steps}), tmp_path, timeout=270
        )
        assert code == 0, output
    assert "resumed from step 2" in output, output
    settings = specs.parse(hybrid_job("clicks", spec | {"steps": 3})).settings
    directory = checkpoint.step_dir(tmp_path / "ckpt", 3)
    pieces = [p for i in (0, 1) for p in torch.load(directory / f"ps{i}.pt")["pieces"]]
    torch.set_default_dtype(torch.float64)
    try:
        model, optimizer = reference.trained(settings, 3)
    finally:
        torch.set_default_dtype(torch.float32)
    for t in settings.embeddings:
        got = reference.assembled(pieces, t.name, t.rows)
        weight = model.tables[t.name].weight.detach()
        torch.testing.assert_close(got["weight"], weight, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(
            got["sum"], optimizer.state[model.tables[t.name].weight]["sum"], rtol=1e-12, atol=1e-14
        )
    dense = torch.load(directory / "dense.pt", weights_only=False)["model"]
    for name, value in model.dense.state_dict().items():
        torch.testing.assert_close(dense[name], value, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "dim",
    [
        4,  # C1 split by rows
        # C1 split by columns: tests/test_recsys.py's column tests hold it, in one process
        pytest.param(16, marks=pytest.mark.slow),
    ],
)
def test_logs_with_empty_and_negative_fields_train_as_dlrm_reads_them_in_float64(
    tmp_path: Path, dim: int
) -> None:
    """Two trainers and two servers, 2 steps on 256 lines with empty and negative fields (two
    gzip files of 128: a lane each, so a step reads every line): the tables, their Adagrad
    state and the dense part equal one process's that reads the lines by itself as DLRM's
    preprocessing does (an empty categorical field is value 0, hashed to row 0), to 1e-9."""
    (tmp_path / "sitecustomize.py").write_text(FLOAT64)
    lines = log_lines(256, 10)
    empty = [[k for k, x in enumerate(line.split(b"\t")) if not x] for line in lines]
    assert sum(1 for e in empty if {14, 15, 16} & set(e)) > 40  # C1-C3 empty: row 0
    write(tmp_path / "day_0.gz", lines[:128])
    write(tmp_path / "day_1.gz", lines[128:])
    data = {"criteo": {"train": str(tmp_path / "day_*.gz")}}
    # On the servers, all three: at this batch `auto` would replicate C2 and peak.
    embeddings = [t | {"dim": dim, "placement": "sharded"} for t in CLICKS["embeddings"]]
    spec = CLICKS | {"data": data, "batchSize": 128, "steps": 2, "embeddings": embeddings}
    ckpt = {"path": str(tmp_path / "ckpt"), "everySteps": 2}
    code, output, summary = run_to_end(
        hybrid_job("clicks", spec | {"checkpoint": ckpt}), tmp_path, 170
    )
    assert code == 0, output
    settings = specs.parse(hybrid_job("clicks", spec)).settings
    c1 = [p.name for s in settings.placement() for p in s if p.table == "C1"]
    assert c1 == (["C1[0:1500]", "C1[1500:3000]"] if dim == 4 else ["C1[:, 0:8]", "C1[:, 8:16]"])
    directory = checkpoint.step_dir(tmp_path / "ckpt", 2)
    pieces = [p for i in (0, 1) for p in torch.load(directory / f"ps{i}.pt")["pieces"]]
    torch.set_default_dtype(torch.float64)
    try:
        whole = itertools.repeat(reference.as_dlrm_reads(lines))  # every step reads them all
        model, optimizer = reference.trained_on(settings, 13, whole, 2)
        start, _ = reference.trained_on(settings, 13, whole, 0)
        values, ids, offsets, labels = next(whole)
        logits = start(values, ids, offsets)
        first_loss = F.binary_cross_entropy_with_logits(logits, labels).item()
    finally:
        torch.set_default_dtype(torch.float32)
    assert summary is not None  # the trainers' mean step-1 loss, each over its half
    assert summary["firstLoss"] == pytest.approx(first_loss, rel=1e-12, abs=0)
    for t in settings.embeddings:
        got, weight = reference.assembled(pieces, t.name, t.rows), model.tables[t.name].weight
        torch.testing.assert_close(got["weight"], weight.detach(), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(
            got["sum"], optimizer.state[weight]["sum"], rtol=1e-9, atol=1e-12, msg=t.name
        )
    dense = torch.load(directory / "dense.pt", weights_only=False)["model"]
    for name, value in model.dense.state_dict().items():
        torch.testing.assert_close(dense[name], value, rtol=1e-9, atol=1e-12, msg=name)
