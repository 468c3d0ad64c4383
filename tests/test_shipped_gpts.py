"""nanoGPT's, minGPT's and llm.c's GPT as their repositories ship them (issue 56's acceptance),
imported from checkouts under the folder PIPEJOB_SHIPPED_GPTS names (userpkg.shipped_gpts;
no copy of them lives here): without spec.loss the master's check refuses their `(logits,
None)` before any stage is built, saying what to give; with a loss in the manifest each
trains on the tokens data source in 2 stages, its step 1 equal to one process's. Where the
folder does not hold a repository the test skips, naming it. test_traced_outputs holds the
same classes on copies of their forwards without the checkouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from one_process import assert_output_is_the_step, first_step
from test_traced_outputs import gpt_job, refuses_the_default_loss
from userpkg import shipped_gpts

from jobrun import run_to_end

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).parent
LR = 1.0
TOLERANCE = 1e3 * torch.finfo(torch.float32).eps  # float32's noise (test_library_jobs.py's)


def needs(kind: str) -> None:
    if shipped_gpts.shipped(kind) is None:
        pytest.skip(f"{shipped_gpts.FOLDER} holds no {shipped_gpts.FILES[kind]}")


@pytest.mark.parametrize("kind", list(shipped_gpts.FILES))
def test_the_default_loss_on_a_shipped_gpt_is_refused_naming_what_to_give(kind):
    needs(kind)
    with torch.device("meta"):
        refuses_the_default_loss(shipped_gpts.build(kind))


def trains_as_one_process(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    needs(kind)
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # userpkg; the folder is in the environment
    manifest = gpt_job("shipped_gpts", tmp_path)
    manifest["metadata"]["name"] = kind
    manifest["spec"] |= {
        "model": {"import": "userpkg.shipped_gpts:build", "args": {"kind": kind}},
        "steps": 1,
        "optimizer": {"name": "sgd", "lr": LR, "momentum": 0},
        "output": {"path": str(tmp_path / "out")},
    }
    code, output, summary = run_to_end(manifest, tmp_path, timeout=240)
    assert code == 0, output[-3000:]
    assert summary is not None and summary["steps"] == 1, summary
    step = first_step(manifest, LR)
    assert_output_is_the_step(tmp_path / "out", summary, step, LR, TOLERANCE)


def test_nanogpt_as_it_ships_trains_on_tokens_as_one_process(tmp_path, monkeypatch):
    trains_as_one_process("nanogpt", tmp_path, monkeypatch)


# A world each; nanoGPT's above holds the path (minGPT's gives every position's logits, which
# traced_cases.gpt_loss takes; llm.c's forward is nanoGPT's).
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mingpt", "llmc"])
def test_mingpt_and_llmc_as_they_ship_train_on_tokens_as_one_process(kind, tmp_path, monkeypatch):
    trains_as_one_process(kind, tmp_path, monkeypatch)
