"""pipejob's own transformer language model on real text: a byte-level token file made from
Python's standard library sources (no download), in 2 and 3 stages. One step's loss and
gradients equal a single process's; a run's loss falls and its held-out perplexity is
reported; and a resumed run sees exactly the samples an uninterrupted one does."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from userdata import BYTE_VOCAB, write_stdlib_tokens

from jobrun import check_gradients, pipeline_job, run_to_end
from pipejob.core import spec

pytestmark = pytest.mark.timeout(240)

TRANSFORMER = {"vocabSize": BYTE_VOCAB, "layers": 3, "width": 64, "heads": 4, "seqLen": 64}


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stdlib-bytes")
    train, val = root / "train.bin", root / "val.bin"
    assert write_stdlib_tokens(train, max_bytes=400_000) == 400_000
    write_stdlib_tokens(val, max_bytes=60_000, split="val")
    return {"train": str(train), "val": str(val)}


def lm_job(name: str, text: dict[str, str], **fields: Any) -> dict[str, Any]:
    return pipeline_job(
        name,
        **{
            "model": {"transformer": TRANSFORMER},
            "data": {"tokens": text, "workers": 1},
            "batchSize": 16,
            "microBatches": 4,
            "optimizer": {"name": "adam", "lr": 0.003},
            **fields,
        },
    )


# 3 stages has a middle stage besides the first and last: 2 is its `slow` variant.
@pytest.mark.parametrize("stages", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_one_step_equals_a_single_process(text, tmp_path: Path, stages: int):
    job = spec.parse(lm_job("lm-gradients", text, stages=stages, steps=1))
    got = check_gradients(job, tmp_path)
    assert got["stages"][0][0] == "embed" and got["stages"][-1][-1] == "head"
    assert got["loss"] == pytest.approx(math.log(BYTE_VOCAB), rel=0.05)  # untrained: uniform


# slow: the 3-stage step's exactness above; perplexity in process in test_any_model.py
@pytest.mark.slow
def test_the_loss_falls_and_perplexity_is_reported(text, tmp_path: Path):
    steps = 60
    job = lm_job(
        "lm",
        text,
        stages=3,
        steps=steps,
        logEvery=20,
        eval={"everySteps": 30, "batches": 8},
        splitPoints=["blocks.1", "norm"],  # the user's cut, not the measured one
    )
    code, out, summary = run_to_end(job, tmp_path, timeout=220)
    assert code == 0, out
    losses = summary["losses"]
    assert sum(losses[-10:]) / 10 < losses[0] - 1.5, losses  # from ln 256 = 5.5 towards text
    evaluation = summary["evaluation"]
    assert evaluation["step"] == steps and evaluation["samples"] == 8 * 16
    # Byte-level stdlib text: far better than uniform (256) after 60 steps.
    assert 1 < evaluation["perplexity"] < 40, evaluation
    assert evaluation["perplexity"] == pytest.approx(math.exp(evaluation["loss"]), rel=1e-3)
    assert [e["step"] for e in summary["evaluations"]] == [30, 60]
    assert "eval step 30: loss " in out and ", perplexity " in out
    assert f"held-out after step {steps}: loss {evaluation['loss']:.4f}, perplexity" in out
    assert [s["layers"] for s in summary["partition"]] == [
        ["embed", "blocks.0"],
        ["blocks.1", "blocks.2"],
        ["norm", "head"],
    ]


# slow: two worlds, one killed: test_checkpoint.py's resumed pipeline matches an uninterrupted one
@pytest.mark.slow
def test_a_resumed_run_sees_exactly_the_samples_an_uninterrupted_one_sees(text, tmp_path):
    """Shuffled windows of a real file through 2 DataLoader workers: the run that stops at
    step 4 and resumes trains steps 5..8 on the same batches as the run that never stopped,
    so its losses are the same (a repeated or skipped sample would change them)."""
    common = {"stages": 2, "logEvery": 4, "data": {"tokens": text, "workers": 2}}
    whole = lm_job(
        "whole",
        text,
        steps=8,
        **common,
        checkpoint={"path": str(tmp_path / "whole"), "everySteps": 4},
    )
    code, out, uninterrupted = run_to_end(whole, tmp_path, timeout=150)
    assert code == 0, out
    part = {**common, "checkpoint": {"path": str(tmp_path / "part"), "everySteps": 4}}
    code, out, _ = run_to_end(lm_job("part", text, steps=4, **part), tmp_path, timeout=150)
    assert code == 0, out
    code, out, resumed = run_to_end(lm_job("part", text, steps=8, **part), tmp_path, timeout=150)
    assert code == 0, out
    assert "resumed from step 4" in out
    assert resumed["resumedFromStep"] == 4 and len(resumed["losses"]) == 4
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][4:], rel=1e-5, abs=1e-6)
    assert resumed["losses"] != pytest.approx(uninterrupted["losses"][:4], rel=1e-3)
