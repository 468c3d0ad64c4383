"""A run that goes non-finite stops (issue 30, runtime/nonfinite.py): a user's model that
returns NaN at step 3 fails the job within that step, permanently (reason NonFinite), the
line naming the step, the stage whose forward first gave a non-finite value and the value;
the checkpoint of step 2 is intact and no output is written. With skipNonFiniteSteps the
step is skipped instead (here its gradients go non-finite, naming the stage whose backward
did) and the run ends with finite weights. The evaluation never reports a figure computed
from non-finite outputs. Both engines are seen: the pipelining
engine here, the rpc engine skipping here and failing on the emulated cluster
(test_operator_refusals_e2e.py)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.variants import exhaustive
from jobrun import pipeline_job, run_to_end
from pipejob.core.contract import ExitCode
from pipejob.trainer.runtime import checkpoint
from pipejob.trainer.runtime.nonfinite import Guard, NonFiniteError, RoundChecks
from pipejob.trainer.workloads.metrics import CLASSIFICATION, Tally, cross_entropy

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).parent  # holds userpkg/, brought by `import:` as a user's package
AT = 3
# The pipelining engine with torch's GPipe schedule (1f1b wants a micro-batch per stage).
PIPELINING = {"engine": "pipelining", "schedule": "gpipe"}


def blowing_up(name: str, tmp_path: Path, backward: bool = False, **fields) -> dict:
    """A 3-stage job whose model gives NaN in step AT's forwards (or backwards), in stage
    1's module 6."""
    args = {"at": AT, "micro_batches": 2, "backward": backward}
    return pipeline_job(
        name,
        **{
            "model": {"import": "userpkg.blowup:cnn", "args": args},
            "stages": 3,
            "splitPoints": ["3", "8"],
            "steps": 5,
            "microBatches": 2,
            "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 1},
            "output": {"path": str(tmp_path / "out")},
            **fields,
        },
    )


def test_a_step_that_goes_non_finite_fails_the_job_keeping_the_last_checkpoint(
    tmp_path: Path, monkeypatch
):
    """On the pipelining engine (the rpc engine's is the emulated cluster's test), its
    checkpoints two steps apart: the steps between go to the stages in calls of several
    (where a step takes under a quarter of a second), which the non-finite one stops."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    job = blowing_up("nan", tmp_path, **PIPELINING)
    job["spec"]["checkpoint"]["everySteps"] = 2
    code, out, _ = run_to_end(job, tmp_path, timeout=240)
    assert code == ExitCode.PERMANENT, out
    said = (
        f"permanent: NonFinite: training failed: NonFiniteError: step {AT}: the loss is nan,"
        " first non-finite in stage1's forward; its update was not kept"
    )
    assert said in out, out[-3000:]
    assert f"step {AT}/" not in out  # the step never completed
    last = checkpoint.latest(tmp_path / "ckpt")  # the last good step's, whole (checksums)
    assert last is not None and last.step == AT - 1, last
    for entry in last.manifest["files"]:
        weights = last.load(entry["name"]).get("model", {})
        assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.slow  # the guard's skip in process below; the stop on a non-finite step above
def test_skipped_non_finite_steps_leave_the_weights_as_they_were(tmp_path: Path, monkeypatch):
    """Here the gradients go non-finite (the loss is finite): the latest stage in the
    backward whose gradients are not is named. On the rpc engine."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    job = blowing_up("skip", tmp_path, backward=True, skipNonFiniteSteps=1, engine="rpc")
    code, out, _ = run_to_end(job, tmp_path, timeout=240)
    assert code == ExitCode.SUCCEEDED, out[-3000:]
    assert (
        f"step {AT}: the gradient norm is nan, first non-finite in stage1's backward:"
        " skipped, the weights left as they were (1 of 1 allowed)"
    ) in out
    state = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in state.values())


# What the trainer says: its training loss (before the backward), or its evaluation's outputs.
HYBRID_SAYS = {
    "train": rf"step {AT}: the loss is nan on trainer0; its update was not applied",
    "held-out": r"the held-out batch after 0 samples: the model's outputs are not finite; no"
    r" figure is reported from them",
}


# The pipeline's stop on a non-finite step above holds the hybrid job's: both are `slow`.
@pytest.mark.parametrize("phase", exhaustive(HYBRID_SAYS, set()))
def test_a_hybrid_job_stops_on_a_non_finite_loss_or_held_out_output(
    phase: str, tmp_path: Path, monkeypatch
):
    """A HybridJob stops too: on the trainer whose loss is not finite, before the backward
    that would update the tables on the parameter servers; or in an evaluation whose
    outputs are not finite, which reports no figure."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    held_out = phase == "held-out"
    job = {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": "nan-hybrid"},
        "spec": {
            "trainers": 1,
            "embedding": {"numEmbeddings": 64, "dim": 8},
            "dense": {
                "outFeatures": 4,
                "import": "userpkg.blowup:dense",
                "args": {"at": AT, "dim": 8, "classes": 4, "held_out": held_out},
            },
            "steps": 5,
            "batchSize": 8,
            "bagSize": 4,
            "datasetSize": 40,
            **({"eval": {"everySteps": 1}} if held_out else {}),
            "rendezvousTimeoutSeconds": 60,
            "preflight": {"megabytes": 0.5},
        },
    }
    code, out, _ = run_to_end(job, tmp_path, timeout=240)
    assert code == ExitCode.PERMANENT, out
    said = r"permanent: NonFinite: training failed: NonFiniteError on trainer0: "
    assert re.search(said + HYBRID_SAYS[phase], out), out[-3000:]
    assert "eval step" not in out  # no figure reported


def test_the_guard_stops_at_the_first_unless_told_to_skip():
    with pytest.raises(
        NonFiniteError,
        match=r"step 7: the gradient norm is inf, first"
        r" non-finite in stage0's backward",
    ):
        Guard().check(7, "gradient norm", math.inf, "stage0's backward")
    guard = Guard(allowed=2)
    assert "skipped" in guard.check(1, "loss", math.nan, "stage1's forward")
    assert "(2 of 2 allowed)" in guard.check(2, "loss", math.nan, "stage1's forward")
    with pytest.raises(NonFiniteError, match=r"\(2 such step\(s\) skipped before\)"):
        guard.check(3, "loss", math.nan, "stage1's forward")


def test_the_evaluation_reports_no_figure_from_non_finite_outputs():
    """The issue's nn.TransformerEncoder reported a held-out accuracy of 100% from NaN
    logits (argmax of NaN): a tally of non-finite outputs fails instead."""
    tally = Tally(CLASSIFICATION)
    labels = torch.tensor([0, 1])
    tally.add(torch.tensor([[2.0, 0.0], [0.0, 2.0]]), labels, cross_entropy)
    with pytest.raises(
        NonFiniteError, match="held-out batch after 2 samples: the model's outputs are not finite"
    ):
        tally.add(torch.tensor([[math.nan, 0.0], [0.0, 1.0]]), labels, cross_entropy)
    assert tally.result()["accuracy"] == 1.0 and tally.samples == 2  # the finite batch only


def test_a_rounds_checks_are_judged_together_whatever_its_outputs_dtypes():
    """A round's output checks are sums judged at its end (RoundChecks): one non-finite
    output among finite ones, of one dtype or several, or inside a dict, fails the round;
    a round of finite outputs, or of none, passes."""

    def judged(*outputs: object) -> bool:
        checks = RoundChecks(deferred=True)
        for output in outputs:
            checks.add(output)
        return bool(checks.joined())

    finite = (torch.ones(2, 3), torch.zeros(2, dtype=torch.float64))
    assert judged(finite, (torch.ones(4, requires_grad=True) * 2,))
    assert judged() and judged((torch.arange(3),))  # integers are not checked
    assert not judged(finite, (torch.tensor([1.0, math.inf]),))
    assert not judged((torch.tensor([math.nan], dtype=torch.bfloat16),), finite)
    assert not judged({"logits": torch.tensor([0.0, -math.inf]), "n": 3})
