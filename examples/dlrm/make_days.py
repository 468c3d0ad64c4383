"""Writes a Criteo-format click-log set of any size as Criteo's Terabyte days ship: gzip day
files day_0.gz ... day_{n-1}.gz (no newline after a file's last line) and a held-out val.gz.
Written the way Criteo's are: empty integer and categorical fields at Criteo's rates, a
negative I2 now and then, and 8-hex-digit categorical values drawn (long-tailed) from
vocabularies of Criteo's Kaggle sizes (up to 10 million values). Clicks follow a hidden
logistic model of I1, I2 and C1-C4, at about Criteo's 25% rate, so a DLRM learns an AUC
above 0.5. Each day comes from its own seed; days are written in parallel.

    python make_days.py --lines 10000000 --days 4 --out /data/criteo   # about 2.3 GB of text
    python make_days.py --lines 200000 --days 1 --plain --out .        # day_0.tsv, val.tsv
"""

from __future__ import annotations

import argparse
import gzip
import math
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# Criteo Kaggle's vocabulary sizes of C1 ... C26, and the share of empty fields of each column.
VOCABULARY = [
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
]
EMPTY_DENSE = [0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22]
EMPTY_CATEGORICAL = [0.0] * 19 + [0.44, 0.0, 0.76, 0.0, 0.04, 0.44, 0.44]
SCALE = [3, 100, 20, 7, 18000, 110, 16, 12, 100, 1, 3, 1, 8]  # the integers' typical size
SEED = 20261128
LINES_AT_ONCE = 10_000


def value(feature: int, index: int) -> str:
    """The index-th value of a feature's vocabulary, as Criteo writes one: 8 hex digits."""
    return f"{(index * 0x9E3779B1 + feature * 0x85EBCA77 + 0x27D4EB2F) & 0xFFFFFFFF:08x}"


def weight(feature: int, index: int) -> float:
    """The hidden model's weight of a value of C1-C4 (0 for the other features)."""
    if feature >= 4:
        return 0.0
    mixed = (index * 2654435761 + feature * 40503) % 1000
    return (mixed / 1000 - 0.5) * (3.0 - 0.5 * feature)


def line(rng: random.Random) -> str:
    score = -1.3
    dense = []
    for i in range(13):
        if rng.random() < EMPTY_DENSE[i]:
            dense.append("")
            continue
        x = int(rng.expovariate(1.0 / SCALE[i])) - (rng.random() < 0.05 if i == 1 else 0) * 3
        if i < 2:
            score += (0.35 if i == 0 else -0.25) * math.log1p(max(x, 0))
        dense.append(str(x))
    categorical = []
    for k, size in enumerate(VOCABULARY):
        if rng.random() < EMPTY_CATEGORICAL[k]:
            categorical.append("")
            continue
        index = min(int(math.exp(rng.random() * math.log(size))) - 1, size - 1)  # long-tailed
        score += weight(k, index)
        categorical.append(value(k, index))
    label = int(rng.random() < 1.0 / (1.0 + math.exp(-score)))
    return "\t".join([str(label), *dense, *categorical])


def write(path: Path, count: int, seed: int, level: int) -> str:
    """`count` lines into `path` (gzip at `level` for a .gz name), no newline after the last."""
    rng = random.Random(seed)
    opened = gzip.open(path, "wt", compresslevel=level) if path.suffix == ".gz" else open(path, "w")
    with opened as out:
        for start in range(0, count, LINES_AT_ONCE):
            lines = [line(rng) for _ in range(min(LINES_AT_ONCE, count - start))]
            out.write(("\n" if start else "") + "\n".join(lines))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=10_000_000, help="training lines, all days")
    parser.add_argument("--days", type=int, default=4, help="day files (4)")
    parser.add_argument("--val", type=int, default=100_000, help="held-out lines (100000)")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder")
    parser.add_argument("--plain", action="store_true", help="plain text (.tsv), not gzip")
    parser.add_argument("--level", type=int, default=1, help="gzip level (1: fast)")
    parser.add_argument("--workers", type=int, default=2, help="days written at once")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = ".tsv" if args.plain else ".gz"
    jobs = [
        (
            args.out / f"day_{d}{suffix}",
            (d + 1) * args.lines // args.days - d * args.lines // args.days,
            SEED + d,
        )
        for d in range(args.days)
    ]
    jobs.append((args.out / f"val{suffix}", args.val, SEED - 1))
    with ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(write, path, count, seed, args.level) for path, count, seed in jobs]
        for future in futures:
            print(future.result())


if __name__ == "__main__":
    main()
