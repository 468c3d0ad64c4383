"""Outputs as one process sees them on the traced path (issue 56, class 3): values beside
the batch (a 0-dim loss, None, a Python value) are carried to the loss as the model computed
them per micro-batch, never concatenated; what the master's check knows the default loss
cannot take is refused before any stage is built, saying what to give; and GPTs with the
forwards the popular repositories ship (`forward(idx, targets=None) -> (logits, loss)`:
userpkg/gpt_forwards.py; the real files run in test_shipped_gpts.py) train on the tokens data
source with a loss given in the manifest."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from test_runner import alive
from torch import nn
from userpkg import gpt_forwards

from jobrun import STARTED, JobRun, pipeline_job, run_to_end
from pipejob.core.contract import ExitCode
from pipejob.trainer.pipeline.shape_check import fits_model
from pipejob.trainer.workloads import metrics
from pipejob.trainer.workloads.cut import Traced, join

pytestmark = pytest.mark.timeout(120)


class Sparse(nn.Module):
    """TabNet's shape of output: (logits, sparsity loss), the loss a mean over samples."""

    def __init__(self):
        super().__init__()
        self.mask = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = torch.softmax(self.mask(x), -1)
        sparsity = (m * torch.log(m + 1e-10)).sum(-1).mean()
        return self.head(m * x), sparsity


def pipelined(model: nn.Module, x: torch.Tensor, parts: list[int]) -> object:
    """The model cut in two, run on micro-batches of `parts` samples, their outputs joined
    as the last stage joins them."""
    traced = Traced(model, 4, sample=x[:2])
    first, last = traced.split([traced.units[-1]])
    outputs = []
    for mb in x.split(parts):
        passed = first(mb)
        outputs.append(last(*passed) if isinstance(passed, tuple) else last(passed))
    return join(outputs)


def test_a_zero_dim_loss_beside_the_logits_is_carried_not_concatenated():
    """Its value over the micro-batches is their mean weighted by their samples: one
    process's where the scalar is a mean over the batch's samples; its gradient too."""
    torch.manual_seed(0)
    model, x = Sparse(), torch.randn(7, 6)
    logits, sparsity = pipelined(model, x, [4, 3])
    whole_logits, whole_sparsity = model(x)
    torch.testing.assert_close(logits, whole_logits)
    torch.testing.assert_close(sparsity, whole_sparsity)
    (grad,) = torch.autograd.grad(sparsity, model.mask.weight)
    (expected,) = torch.autograd.grad(whole_sparsity, model.mask.weight)
    torch.testing.assert_close(grad, expected)


def test_none_and_python_values_beside_the_batch_are_kept():
    """nanoGPT's (logits, None); a flag every micro-batch computes alike is itself, values
    that differ are the micro-batches' list."""
    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 16))
    model = gpt_forwards.nanogpt()
    logits, loss = pipelined(model, x, [2, 2])
    assert loss is None
    torch.testing.assert_close(logits, model(x)[0])
    assert join([(torch.ones(2), "greedy", 1), (torch.ones(3), "greedy", 2)])[1:] == (
        "greedy",
        [1, 2],
    )


@pytest.mark.parametrize("module", ["nanogpt", "mingpt", "llmc"])
def test_the_default_loss_on_a_gpts_tuple_is_refused_naming_what_to_give(module):
    """The master's fit check knows the default loss cannot take (logits, None): it refuses
    the job there (a permanent failure, before any stage is built), saying what to give."""
    with torch.device("meta"):
        refuses_the_default_loss(getattr(gpt_forwards, module)())


def refuses_the_default_loss(model: nn.Module) -> None:
    """The fit check refuses the default loss on `model`'s (logits, None), naming what to give."""
    tokens = torch.randint(0, 64, (2, 17))
    with pytest.raises(ValueError) as refused:
        fits_model(model, tokens[:, :-1], tokens[:, 1:], metrics.cross_entropy)
    said = str(refused.value)
    assert said.startswith("spec.loss: the model returns ((2, ") and ", None):" in said, said
    assert "give spec.loss: {import: mypkg.losses:build}" in said


def write_tokens(path: Path, count: int = 4096) -> Path:
    """A token file (nanoGPT's format, uint16) of a learnable sequence: i+1 follows i."""
    np.array([i % 64 for i in range(count)], dtype=np.uint16).tofile(path)
    return path


def gpt_job(module: str, tmp_path: Path) -> dict:
    manifest = pipeline_job(
        module.replace("_", "-"),
        model={"import": f"userpkg.gpt_forwards:{module}"},
        data={"tokens": {"train": str(write_tokens(tmp_path / "tokens.bin")), "seqLen": 16}},
        loss={"import": "userpkg.traced_cases:gpt_loss"},
        eval={"everySteps": 0},
        stages=2,
        microBatches=2,
        batchSize=8,
        steps=4,
        logEvery=2,
    )
    for key in ("imageSize", "numClasses"):  # the small pipeline's, for its resnet
        del manifest["spec"][key]
    return manifest


def trains(module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # userpkg, in every process
    code, output, summary = run_to_end(gpt_job(module, tmp_path), tmp_path, timeout=240)
    assert code == 0, output[-3000:]
    assert summary is not None and summary["steps"] == 4, summary
    assert math.isfinite(summary["finalLoss"]), summary
    # The master checked the data against the model before any stage started.
    checked, started = output.index("| data: "), output.index("pipejob: started stage0")
    assert checked < started, output[:3000]


def test_without_a_loss_a_gpt_is_refused_before_any_other_member_starts(tmp_path, monkeypatch):
    """`pipejob run` starts the master alone; its check refuses the default loss on the
    GPT's (logits, None) before the world forms: no stage ever starts, no preflight runs, the
    job fails permanently naming spec.loss and what to give, and nothing is left behind."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # userpkg, in every process
    manifest = gpt_job("nanogpt", tmp_path)
    del manifest["spec"]["loss"]
    manifest["spec"] |= {"output": {"path": str(tmp_path / "out")}}
    manifest["spec"] |= {"checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 1}}
    with JobRun(manifest, tmp_path) as run:
        code = run.finish(timeout=100)
    assert code == ExitCode.PERMANENT, run.output
    assert [m[1] for m in STARTED.finditer(run.output)] == ["master"], run.output
    said = re.search(r"^pipejob: master \(role master, rank 0\) failed: (.*)$", run.output, re.M)
    assert said is not None, run.output
    assert said[1].startswith("exit code 5: permanent: InvalidConfiguration:"), said[1]
    assert "spec.loss: the model returns ((2, 1, 64) float32, None)" in said[1], said[1]
    assert "give spec.loss: {import: mypkg.losses:build}" in said[1], said[1]
    assert "preflight" not in run.output and "stopping the other" not in run.output
    assert not run.summary_file.exists()
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()
    assert not alive(run.pid("master")), run.output


@pytest.mark.timeout(300)
def test_a_nanogpt_forward_trains_on_tokens_with_a_loss_given(tmp_path, monkeypatch):
    trains("nanogpt", tmp_path, monkeypatch)


# A world each: nanoGPT's holds the path (its forward is llm.c's; minGPT's differs in giving
# every position's logits, which the in-process tests above hold).
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("module", ["mingpt", "llmc"])
def test_mingpt_and_llmc_forwards_train_on_tokens_with_a_loss_given(module, tmp_path, monkeypatch):
    trains(module, tmp_path, monkeypatch)
