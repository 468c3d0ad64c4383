"""Click logs in the Criteo layout: one sample a line, `label I1 ... I13 C1 ... C26`
tab-separated; the counts read as log(1 + x), the categorical values hexadecimal (the
user guide's "HybridJob at recommendation scale" says it all). `parse` reads one line,
`parse_many` a batch of them (its digits read by numpy); the trainers stream the logs
(clicklogs.py); `CriteoLog` maps one plain file and finds where
every line starts (8 bytes a line), for small files and the tests. A bad line is a
ValueError naming the file, the line and the column."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pipejob.core.kinds.hybrid import CRITEO_DENSE, CRITEO_FEATURES

DENSE, FEATURES = CRITEO_DENSE, CRITEO_FEATURES
COLUMNS = 1 + DENSE + len(FEATURES)
LAYOUT = "label, I1 ... I13, C1 ... C26, tab-separated"
Sample = tuple[list[float], dict[str, list[int]], int]  # (dense, {C1: [value], ...}, label)


class CriteoLog:
    def __init__(self, path: str, field: str):
        self.path, self.field = path, field
        if not Path(path).is_file():
            raise ValueError(f"{field}: {path}: no such file (a click log: {LAYOUT})")
        if Path(path).stat().st_size == 0:
            raise ValueError(f"{field}: {path} is empty")
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        ends = np.flatnonzero(self.data == ord("\n"))
        if len(ends) == 0 or ends[-1] != len(self.data) - 1:  # a last line without its newline
            ends = np.append(ends, len(self.data))
        self.starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        self.ends = ends.astype(np.int64)
        self.sample(0)  # a file in another layout fails now, naming its first line

    @property
    def size(self) -> int:
        return len(self.starts)

    def sample(self, i: int) -> Sample:
        """Line i (from 0): (log(1 + I1..I13), {C1: [value], ...}, label)."""
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} outside {self.path}'s {self.size} lines")
        line = bytes(self.data[self.starts[i] : self.ends[i]])
        try:
            return parse(line)
        except ValueError as e:
            raise ValueError(f"{self.field}: {self.path} line {i + 1}: {e}") from None


def parse(line: bytes) -> Sample:
    """One line (without its newline): (log(1 + I1..I13), {C1: [value], ...}, label). A bad
    one is a ValueError naming the column and the reason (the caller adds where)."""
    columns = line.rstrip(b"\r").split(b"\t")
    if len(columns) != COLUMNS:
        raise ValueError(f"{len(columns)} columns, not {COLUMNS} ({LAYOUT})")
    try:
        label = int(columns[0])
        dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in columns[1 : 1 + DENSE]]
        categorical = [int(x, 16) if x else 0 for x in columns[1 + DENSE :]]
    except ValueError:
        raise ValueError(_first_bad(columns)) from None
    if label not in (0, 1):
        raise ValueError(f"the label is {label}, not 0 or 1")
    return dense, {f: [v] for f, v in zip(FEATURES, categorical, strict=True)}, label


def parse_many(lines: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Many lines at once, as `parse` reads each: (log(1 + I1..I13) (n, 13) float64, C1..C26
    (n, 26) int64, labels (n,) int64); None if any line is bad (`parse` it to say which).
    Digits are read by numpy, all fields of a kind at once (a Python int() a field cost a
    trainer 2 ms of CPU a step of 256 lines); a field numpy does not read as plain digits
    (a sign other than '-', spaces, '0x', too many digits) has Python read the lines."""
    text = b"\t".join(line.rstrip(b"\r") for line in lines)
    data = np.frombuffer(text, dtype=np.uint8)
    tabs = np.flatnonzero(data == ord("\t"))
    if len(tabs) != COLUMNS * len(lines) - 1:
        return None
    starts = np.concatenate([[0], tabs + 1]).reshape(len(lines), COLUMNS)
    ends = np.append(tabs, len(data)).reshape(len(lines), COLUMNS)
    labels = _digits(data, starts[:, 0], ends[:, 0], 10, empty=False)
    dense = _digits(data, starts[:, 1 : 1 + DENSE], ends[:, 1 : 1 + DENSE], 10)
    categorical = _digits(data, starts[:, 1 + DENSE :], ends[:, 1 + DENSE :], 16)
    if labels is None or dense is None or categorical is None:
        return _parse_many_in_python(lines)
    if ((labels != 0) & (labels != 1)).any():
        return None
    return np.log1p(np.maximum(dense.astype(np.float64), 0.0)), categorical, labels


# Each byte's value as a digit (-1: not one), and the most digits int64 holds in each base.
_DIGIT = np.full(256, -1, dtype=np.int8)
_DIGIT[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_DIGIT[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_DIGIT[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)
_MOST_DIGITS = {10: 18, 16: 15}


def _digits(
    data: np.ndarray, starts: np.ndarray, ends: np.ndarray, base: int, empty: bool = True
) -> np.ndarray | None:
    """The integers of the fields data[starts:ends] (any shape) in `base`, an empty field 0
    (where `empty`); None where a field is not an optional '-' and digits."""
    at = np.minimum(starts, len(data) - 1)  # an empty last field starts at the end
    negative = (ends > starts) & (data[at] == ord("-"))
    first = starts + negative
    width = ends - first
    if (negative & (width == 0)).any() or (not empty and (width == 0).any()):
        return None
    most = int(width.max(initial=0))
    if most > _MOST_DIGITS[base]:
        return None
    # Every field's last `most` bytes, right-aligned: position k is worth base**(most-1-k).
    places = np.arange(most)
    outside = places < most - width[..., None]
    digit = _DIGIT.take(data.take(ends[..., None] - most + places, mode="clip"))
    digit[outside] = 0
    if (digit < 0).any() or (base == 10 and (digit >= base).any()):
        return None
    value = digit.astype(np.int64) @ base ** (most - 1 - places)
    return np.where(negative, -value, value)


def _parse_many_in_python(lines: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`parse_many` by Python's int(), for what numpy does not read; None if a line is bad."""
    fields = b"\t".join(line.rstrip(b"\r") for line in lines).split(b"\t")
    if len(fields) != COLUMNS * len(lines):
        return None
    try:
        labels = np.array([int(x) for x in fields[0::COLUMNS]], dtype=np.int64)
        dense = np.array(
            [int(x) if x else 0 for k in range(1, 1 + DENSE) for x in fields[k::COLUMNS]],
            dtype=np.float64,
        )
        categorical = np.array(
            [int(x, 16) if x else 0 for k in range(1 + DENSE, COLUMNS) for x in fields[k::COLUMNS]],
            dtype=np.int64,
        )
    except (ValueError, OverflowError):
        return None
    if ((labels != 0) & (labels != 1)).any():
        return None
    dense = np.log1p(np.maximum(dense, 0.0)).reshape(DENSE, -1).T
    return dense, categorical.reshape(len(FEATURES), -1).T, labels


def _first_bad(columns: list[bytes]) -> str:
    """Which column of a line does not read, and why."""
    names = ["label", *(f"I{k}" for k in range(1, 1 + DENSE)), *FEATURES]
    for k, (name, x) in enumerate(zip(names, columns, strict=True)):
        base = 16 if k > DENSE else 10
        try:
            int(x or b"0", base)
        except ValueError:
            said = "a hexadecimal string" if base == 16 else "an integer"
            return f"{name} is {x.decode('ascii', 'replace')!r}, not {said} ({LAYOUT})"
    return f"not {LAYOUT}"
