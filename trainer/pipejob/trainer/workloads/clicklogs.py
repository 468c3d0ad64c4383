"""Click logs of any size, streamed (spec.data.criteo): plain or gzip files cut into chunks,
dealt each epoch to `lanes` (trainers.max) streams read through shuffled windows, so a
step's batch is the same at any trainer count and a position resumes exactly; memory does
not grow with the logs. How: docs/architecture.md, "Click logs of any size"."""

from __future__ import annotations

import dataclasses
import glob
import gzip
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pipejob.trainer.workloads import criteo

CHUNK_BYTES = 64 << 20  # a plain file's chunks
WINDOW_LINES = 1 << 15  # a lane's shuffle window: at most these lines ...
WINDOW_BYTES = 16 << 20  # ... or these bytes of them
READ_BUFFER = 1 << 20
ID_BITS = 40  # a line's id: its file's index << ID_BITS | its offset (uncompressed) in it

Row = tuple[int, int, bytes]  # (the lane's epoch, the line's id, the line)


@dataclass(frozen=True)
class Chunk:
    """Lines of file `file` (`path`) starting in bytes start..stop-1 (stop -1: to the end),
    every `stride`-th from the `phase`-th; `weight`: its bytes, to deal the chunks evenly."""

    file: int
    path: str
    start: int
    stop: int
    weight: int
    stride: int = 1
    phase: int = 0


def paths(pattern: str, field: str) -> list[str]:
    """The files `pattern` names (paths or globs, separated by commas), checked."""
    found: list[str] = []
    for part in (p.strip() for p in pattern.split(",") if p.strip()):
        matched = sorted(glob.glob(part)) if glob.has_magic(part) else [part]
        if not matched:
            raise ValueError(f"{field}: {part} matches no file (click logs: {criteo.LAYOUT})")
        found += matched
    for path in found:
        if not Path(path).is_file():
            raise ValueError(f"{field}: {path}: no such file (a click log: {criteo.LAYOUT})")
        if Path(path).stat().st_size == 0:
            raise ValueError(f"{field}: {path} is empty")
    if not found:
        raise ValueError(f"{field}: names no file")
    return found


def gzipped(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _open(path: str) -> IO[bytes]:
    if gzipped(path):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb", buffering=READ_BUFFER)


def chunks_of(files: list[str], lanes: int, chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """The files' chunks (the module's docstring): at least `lanes` of them."""
    chunks: list[Chunk] = []
    for i, path in enumerate(files):
        size = os.path.getsize(path)
        if gzipped(path):
            chunks.append(Chunk(i, path, 0, -1, size))
            continue
        count = max(-(-size // chunk_bytes), lanes)
        chunks += [
            Chunk(i, path, k * size // count, (k + 1) * size // count, size // count)
            for k in range(count)
        ]
    if len(chunks) >= lanes:
        return chunks
    n = -(-lanes // len(chunks))  # only gzip files: each read by n lanes, every n-th line
    return [
        dataclasses.replace(p, weight=max(p.weight // n, 1), stride=n, phase=r)
        for p in chunks
        for r in range(n)
    ]


def lines(chunk: Chunk) -> Iterator[tuple[int, bytes]]:
    """(id, line without its newline) of every line the chunk owns, in the file's order."""
    base = chunk.file << ID_BITS
    with _open(chunk.path) as f:
        offset = 0
        if chunk.start > 0:  # the first line starting at or after `start`
            f.seek(chunk.start - 1)
            offset = chunk.start - 1 + len(f.readline())
        for n, line in enumerate(f):
            if 0 <= chunk.stop <= offset:
                return
            if n % chunk.stride == chunk.phase:
                yield base | offset, line.rstrip(b"\n")
            offset += len(line)


class ClickLogs:
    """The logs `pattern` names, read as `lanes` streams (the module's docstring)."""

    def __init__(
        self,
        pattern: str,
        field: str,
        lanes: int = 1,
        chunk: int = CHUNK_BYTES,
        window: int = WINDOW_LINES,
        window_bytes: int = WINDOW_BYTES,
    ):
        self.field, self.lanes = field, lanes
        self.files = paths(pattern, field)
        self.chunks = chunks_of(self.files, lanes, chunk)
        self.window, self.window_bytes = window, window_bytes
        self.held = self.most_held = 0  # bytes of lines held in windows: now, at most
        self.counts: dict[Chunk, int] = {}  # lines of the chunks counted (to resume)
        self.first = None
        for i, path in enumerate(self.files):  # another layout fails now, naming its line 1
            first = self.parse(*next(lines(Chunk(i, path, 0, -1, 0)), (i << ID_BITS, b"")))
            self.first = self.first or first

    def parse(self, line_id: int, line: bytes) -> criteo.Sample:
        try:
            return criteo.parse(line)
        except ValueError as e:
            raise ValueError(f"{self.field}: {self.where(line_id)}: {e}") from None

    def where(self, line_id: int) -> str:
        """Where a line is, by its id: its file and line (counting the lines before it)."""
        file, offset = line_id >> ID_BITS, line_id & ((1 << ID_BITS) - 1)
        before = Chunk(file, self.files[file], 0, offset, 0)
        return f"{self.files[file]} line {sum(1 for _ in lines(before)) + 1}"

    def deal(self, seed: int, epoch: int) -> list[list[Chunk]]:
        """Each lane's chunks in epoch `epoch`, in the order it reads them."""
        shuffled = list(self.chunks)
        random.Random(f"pipejob-pieces:{seed}:{epoch}").shuffle(shuffled)
        dealt: list[list[Chunk]] = [[] for _ in range(self.lanes)]
        load = [0] * self.lanes
        for chunk in shuffled:
            lane = min(range(self.lanes), key=lambda j: (load[j], j))
            dealt[lane].append(chunk)
            load[lane] += chunk.weight
        return dealt

    def count(self, chunk: Chunk) -> int:
        if chunk not in self.counts:
            self.counts[chunk] = sum(1 for _ in lines(chunk))
        return self.counts[chunk]

    def read(self, lane: int, seed: int, start: int = 0) -> Iterator[Row]:
        """Lane `lane`'s lines forever, epoch after epoch, from its `start`-th on."""
        for epoch in range(1 << 62):
            chunks = self.deal(seed, epoch)[lane]
            if start > 0:
                total = sum(self.count(p) for p in chunks)
                self._check_lines(total, lane, epoch)
                if start >= total:  # the whole epoch is behind the position
                    start -= total
                    continue
            got = 0
            for w, window in enumerate(self._windows(chunks)):
                got += len(window)
                if start < len(window):
                    random.Random(f"pipejob-window:{seed}:{lane}:{epoch}:{w}").shuffle(window)
                    yield from ((epoch, i, line) for i, line in window[start:])
                    start = 0
                else:
                    start -= len(window)
                window.clear()  # its lines go before the next window's are read
            self._check_lines(got, lane, epoch)

    def _check_lines(self, total: int, lane: int, epoch: int) -> None:
        if total == 0:
            raise ValueError(
                f"{self.field}: lane {lane} of {self.lanes} (trainers.max) has no"
                f" lines in epoch {epoch}: the logs ({', '.join(self.files)}) have"
                " too few lines for so many trainers"
            )

    def _windows(self, chunks: list[Chunk]) -> Iterator[list[tuple[int, bytes]]]:
        """The chunks' lines, a window at a time (held while the caller reads it)."""
        window: list[tuple[int, bytes]] = []
        size = 0
        for chunk in chunks:
            for line_id, line in lines(chunk):
                window.append((line_id, line))
                size += len(line)
                if len(window) >= self.window or size >= self.window_bytes:
                    yield from self._hold(window, size)
                    window, size = [], 0
        if window:
            yield from self._hold(window, size)

    def _hold(self, window: list[tuple[int, bytes]], size: int) -> Iterator[list]:
        self.held += size
        self.most_held = max(self.most_held, self.held)
        try:
            yield window
        finally:
            self.held -= size

    def lines_in_order(self) -> Iterator[tuple[int, bytes]]:
        """(id, line) of every line of every file, in order (the held-out set)."""
        for i, path in enumerate(self.files):
            yield from lines(Chunk(i, path, 0, -1, 0))
