"""The conformance harness (benchmarks/conformance.py, issue 30): CI runs its representative
slice (a small model of each construct the issue reported) and every row must be exact; the
harness fails a cut that does not keep the model's state as the model does (a check that
cannot fail proves nothing); and the zoo's table in the docs has no failing row and says how
much of each zoo its rows are."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
DOCS = Path(__file__).resolve().parents[1] / "docs"
sys.path.insert(0, str(BENCHMARKS))

import _conform  # noqa: E402
import _zoos  # noqa: E402
from _conform_page import VERDICTS, ZOO_ORDER  # noqa: E402
from conformance import CI  # noqa: E402

ROW = re.compile(r"^\[\d+/\d+\] (\S+) (.+?): (exact|eager|refused|failing|not built|not run)", re.M)


# slow: two minutes of zoo models: the cut's exactness in test_cut.py, test_any_model.py and
# test_user_libraries.py
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_ci_slice_is_exact():
    """A bound on a hang, not on speed: about a minute on 2 quiet cores."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "conformance.py"), "--slice", "ci", "--timeout", "600"],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = ROW.findall(done.stdout)
    assert len(rows) == len(CI), done.stdout
    assert all(verdict == "exact" for _, _, verdict in rows), done.stdout
    assert re.search(rf"^all\s+{len(CI)}\s+0\s+0\s+0\s+0\s+0\s+\d+$", done.stdout, re.M), (
        done.stdout
    )


def test_a_cut_that_changes_the_models_state_fails_the_check(monkeypatch):
    """Without the cut's keeping the model's state as the model does, the issue's encoder
    (a non-persistent buffer) writes the buffer into its output: check (d) says so."""
    from pipejob.trainer.workloads.cut import Traced

    factory, sample = _zoos.entry("torch", "TransformerEncoder")[1]
    assert _conform.run("torch", "encoder", factory, sample).verdict == "exact"
    monkeypatch.setattr(Traced, "_as_the_model", lambda self, stages: None)
    row = _conform.run("torch", "encoder", factory, sample)
    assert row.verdict == "failing", row
    assert "(d)" in row.why and "feature_mean" in row.why, row


def test_the_docs_table_has_no_failing_row_and_says_how_much_of_each_zoo_it_covers():
    page = (DOCS / "conformance.md").read_text()
    verdicts = "|".join(VERDICTS)
    rows = re.findall(rf"^\| (\w+) \| [^|]+ \| ({verdicts}) \|.*\| (\w[\w-]*) \|$", page, re.M)
    assert rows and all(verdict != "failing" for _, verdict, _ in rows), page[:3000]
    total = re.search(r"^all\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\d+$", page, re.M)
    failing = 1 + VERDICTS.index("failing")
    assert total and total[failing] == "0" and sum(map(int, total.groups())) == len(rows), total
    # The page says how many rows of each zoo it holds, of all the zoo's (or that it is whole).
    totals = {zoo: len(_zoos.names(zoo)) for zoo in ZOO_ORDER}
    partial = re.search(r"\(partial: (\d+) of (\d+) rows so far: (.+?)\)", page)
    if partial is None:
        assert len(rows) == sum(totals.values())
    else:
        assert (int(partial[1]), int(partial[2])) == (len(rows), sum(totals.values()))
        said = {
            zoo: (int(a), int(b)) for zoo, a, b in re.findall(r"(\w+) (\d+) of (\d+)", partial[3])
        }
        assert said == {z: (sum(r[0] == z for r in rows), n) for z, n in totals.items()}, said


def test_the_harness_records_autos_engine_from_what_the_model_passes():
    """Issue 61: each row records the engine `engine: auto` runs the model on, chosen by the
    master's own functions from what the model passes at its cut's candidates: an encoder
    passes only tensors (pipelining); GPT-2's blocks pass ints and tuples (rpc, saying
    where); a model the trace refuses takes the eager path (rpc)."""
    encoder = _zoos.entry("torch", "TransformerEncoder")[1]
    assert _conform._engine(*encoder) == "pipelining"
    gpt2 = _conform._engine(*_zoos.entry("transformers", "causal:gpt2")[1])
    assert gpt2.startswith(
        "rpc: the model passes values other than tensors (ints, tuples) where transformer.wpe,"
    ), gpt2
    assert gpt2.endswith(" more begin; rpc runs gpipe, not 1f1b"), gpt2


def test_the_docs_table_says_which_engine_auto_chose_and_for_how_many_rows():
    """The page's rows name auto's engine where it is recorded: rpc with why (a transformers
    model whose blocks pass ints or tuples among them), rpc for every eager row, none for a
    row auto cannot run; and its tally per zoo agrees with its rows, the rows not yet
    recorded counted as such."""
    from _conform_page import ENGINE_COLUMN, engine_of, rows_of_page

    page = (DOCS / "conformance.md").read_text()
    rows = rows_of_page(page.splitlines())
    assert f"| {ENGINE_COLUMN} |" in page
    for row in rows:
        engine = row["engine"]
        if not engine:
            continue
        if row["verdict"] == "eager":
            assert engine.startswith("rpc: the trace refused it"), row
        else:
            assert row["verdict"] == "exact", row
            assert engine == "pipelining" or engine.startswith("rpc: the "), row
    assert any(
        r["zoo"] == "transformers" and r["engine"].startswith("rpc: the model passes values")
        for r in rows
    )
    tally = re.search(r"^all\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", page, re.M)
    assert tally, page[:4000]
    kinds = [engine_of(r) for r in rows]
    assert tally.groups() == tuple(str(kinds.count(k)) for k in ("pipelining", "rpc", "", "?"))
