"""Writes the example's click logs, train.tsv and val.tsv, in the Criteo layout: a label (0 or
1), 13 integer features and 26 categorical ones as 8-digit hexadecimal strings, tab-separated,
with values missing as in Criteo's (empty). The same bytes every run (seeded; the standard
library only): tests/test_dlrm.py checks that the shipped files are what this writes.

The clicks follow a hidden logistic model: a few categorical features (C1-C4, with small
vocabularies) and dense ones (I1, I2) carry the signal, the rest is noise, and the click
rate is about 25% as in Criteo's logs, so a DLRM trained on train.tsv scores an AUC well
above 0.5 on val.tsv.

    python make_criteo.py [--train 1000] [--val 250] [--out .]
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

DENSE, CATEGORICAL = 13, 26
SEED = 20261126


def vocabulary(rng: random.Random, size: int) -> list[str]:
    return [f"{rng.getrandbits(32):08x}" for _ in range(size)]


def make(rng: random.Random, count: int, world: dict) -> list[str]:
    lines = []
    for _ in range(count):
        score = world["bias"]
        dense = []
        for i in range(DENSE):
            if rng.random() < world["missing_dense"][i]:
                dense.append("")
                continue
            x = int(rng.expovariate(1.0 / world["scale"][i]))
            score += world["dense_weight"][i] * math.log1p(x)
            dense.append(str(x))
        categorical = []
        for k in range(CATEGORICAL):
            if rng.random() < world["missing_categorical"][k]:
                categorical.append("")
                continue
            values, weights = world["values"][k], world["weights"][k]
            j = min(int(rng.paretovariate(1.2)) - 1, len(values) - 1)  # popular values first
            score += weights[j]
            categorical.append(values[j])
        label = int(rng.random() < 1.0 / (1.0 + math.exp(-score)))
        lines.append("\t".join([str(label), *dense, *categorical]))
    return lines


def hidden_world(rng: random.Random) -> dict:
    sizes = [8, 12, 20, 30] + [rng.choice([5, 50, 200, 1000]) for _ in range(CATEGORICAL - 4)]
    strength = [1.5, 1.2, 1.0, 0.8] + [0.05] * (CATEGORICAL - 4)
    return {
        "bias": -0.2,
        "missing_dense": [rng.choice([0.0, 0.1, 0.4]) for _ in range(DENSE)],
        "scale": [rng.choice([2, 10, 100, 1000]) for _ in range(DENSE)],
        "dense_weight": [0.5, -0.4] + [0.0] * (DENSE - 2),
        "missing_categorical": [0.0] * 19 + [0.4] * (CATEGORICAL - 19),
        "values": [vocabulary(rng, n) for n in sizes],
        "weights": [
            [rng.gauss(0.0, s) for _ in range(n)] for n, s in zip(sizes, strength, strict=True)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=1000, help="training lines (1000)")
    parser.add_argument("--val", type=int, default=250, help="held-out lines (250)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent, help="folder")
    args = parser.parse_args()
    rng = random.Random(SEED)
    world = hidden_world(rng)
    for name, count in (("train.tsv", args.train), ("val.tsv", args.val)):
        (args.out / name).write_text("\n".join(make(rng, count, world)) + "\n")


if __name__ == "__main__":
    main()
