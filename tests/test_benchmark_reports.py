"""What the benchmarks print, computed from results made up here: the fits and tables the
device call's reader relies on, checked in process in `make test` (the scripts' runs are
the slow rehearsals: tests/test_benchmarks.py, tests/test_device.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark(name: str) -> ModuleType:
    """A script of benchmarks/ loaded as a module (its main is not run)."""
    found = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def test_overhead_fits_a_step_as_fixed_plus_per_micro_batch_and_reports_both_parts():
    """overhead.py's fit and tables (its run is the device rehearsal's: tests/test_device.py)."""
    overhead = benchmark("overhead")
    fixed, per, residual = overhead.fit([(1, 0.012), (2, 0.014), (4, 0.018), (8, 0.026)])
    assert (fixed, per, residual) == pytest.approx((0.010, 0.002, 0.0), abs=1e-12)
    results = [
        {"stages": 2, "model": "tiny", "m": m, "system": system, "seconds": s, "least": s}
        for system, (a, b) in {"rpc": (0.004, 0.002), "torch-1f1b": (0.002, 0.001)}.items()
        for m in (2, 4)
        for s in [a + b * m]
    ]
    rows = overhead.table(results, "least").splitlines()
    assert re.search(
        r"^\s+2\s+tiny\s+rpc\s+4\.00\s+2\.000\s+0\.00\s+2\.00x\s+2\.00x\s+2,4$", rows[1]
    ), rows
    assert re.search(r"^\s+2\s+tiny\s+torch-1f1b\s+2\.00\s+1\.000\s+0\.00\s+2,4$", rows[2]), rows
    # Paired turn by turn with torch's same schedule: the median gap of the turns (one turn
    # disturbed by 50 ms), fitted as 2 ms a step plus 1 ms a micro-batch.
    turns = {
        "torch-gpipe": lambda m: [0.010 * m, 0.011 * m, 0.009 * m],
        "rpc": lambda m: [
            0.010 * m + 0.002 + 0.001 * m,
            0.011 * m + 0.052,
            0.009 * m + 0.002 + 0.001 * m,
        ],
    }
    paired = [
        {"stages": 4, "model": "tiny", "m": m, "system": system, "turns": each(m)}
        for system, each in turns.items()
        for m in (1, 2, 8)
    ]
    # The profiled step at one micro-batch shares a timed result's key and has no turns.
    profiled = {"stages": 4, "model": "tiny", "m": 1, "system": "rpc", "phases": {}, "span": 0.1}
    rows = overhead.gaps([*paired, profiled], "turns").splitlines()
    assert len(rows) == 2, rows
    assert re.search(
        r"^\s+4\s+tiny\s+rpc\s+torch-gpipe\s+2\.00\s+1\.000\s+0\.00  1:\+3\.0 2:\+4\.0 8:\+10\.0$",
        rows[1],
    ), rows
