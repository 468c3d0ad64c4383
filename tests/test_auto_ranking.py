"""`microBatches: auto`'s predictor against measurements: on costs recorded from real runs,
it must rank the micro-batch counts as their measured speeds do.

Each tests/data/auto-costs-*.json was written by benchmarks/auto_costs.py (the file says how,
when and on what machine): every cut candidate's forward + backward cost at every count `auto`
considers, measured as the master measures them, and each count's samples/s through
`pipejob run`, in interleaved repeats. A recording from another machine or core count
(e.g. 16 cores) is checked the same way once added."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from pipejob.trainer.pipeline.balance import Host, Prediction, UnitCosts, fastest, predict

RECORDINGS = sorted((Path(__file__).parent / "data").glob("auto-costs-*.json"))
# Two counts are measurably apart when every repeat of one beat every repeat of the other and
# their medians differ by more than this share; closer, they are a tie the predictor may order
# either way. The repeats' spread is the machine's noise (a shared machine's load moves a
# run's speed by tens of percent; each recording says its load), so it sets the tolerance.
TIE = 0.10


def apart(faster: list[float], slower: list[float]) -> bool:
    """Every repeat of `faster` beat every one of `slower`, the medians by more than TIE."""
    median = statistics.median
    return min(faster) > max(slower) and median(faster) > (1 + TIE) * median(slower)


def recorded(path: Path) -> tuple[dict, dict[int, Prediction], dict[int, float]]:
    """The recording, and per count the prediction and the measured (median) samples/s."""
    r = json.loads(path.read_text())
    stages, batch = r["stages"], r["batch"]
    host = [Host(tuple(range(stages)), r["cores"])]  # the local runner: one host for all
    predictions, measured = {}, {}
    for m in r["counts"]:
        c = r["costs"][str(m)]
        predictions[m] = predict(UnitCosts(c["seconds"], c["cpuSeconds"]), stages, m, batch, host)
        measured[m] = statistics.median(r["samplesPerSecond"][str(m)])
    return r, predictions, measured


@pytest.mark.parametrize("path", RECORDINGS, ids=[p.stem for p in RECORDINGS])
def test_the_predictor_ranks_counts_as_measured(path: Path):
    r, predictions, measured = recorded(path)
    rates = {m: r["samplesPerSecond"][str(m)] for m in r["counts"]}
    predicted = {m: p.samples_per_second for m, p in predictions.items()}
    pairs = [(a, b) for a, b in itertools.permutations(r["counts"], 2) if apart(rates[a], rates[b])]
    assert len(pairs) >= len(r["counts"]) - 1, f"too few counts measurably apart: {rates}"
    for a, b in pairs:
        assert predicted[a] > predicted[b], (
            f"measured m={a} {rates[a]} beat m={b} {rates[b]} samples/s, but the predictor"
            f" says {predicted[a]:.1f} <= {predicted[b]:.1f} ({path.name}, {r['machine']})"
        )
    # What `auto` chooses is not measurably slower than the fastest count.
    chosen = fastest(list(predictions.values())).micro_batches
    best = max(measured, key=measured.__getitem__)
    assert chosen == best or not apart(rates[best], rates[chosen]), (chosen, rates)


def test_there_is_a_recording():
    assert RECORDINGS, "tests/data/auto-costs-*.json: record one with benchmarks/auto_costs.py"
