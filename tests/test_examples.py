"""The examples that bring their own code run with `pipejob run` as they are (copied to a
temporary folder, so their outputs land there), and learn."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_recipes import scalars

from pipejob.core import spec
from pipejob.trainer import workloads
from pipejob.trainer.workloads import samples
from pipejob.trainer.workloads.criteo import CriteoLog
from pipejob.trainer.workloads.recsys import Recommender, auc

pytestmark = pytest.mark.timeout(300)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(
    name: str, tmp_path: Path, manifest: str = "pipelinejob.yaml"
) -> tuple[dict, str, Path]:
    folder = tmp_path / name
    shutil.copytree(
        EXAMPLES / name, folder, ignore=shutil.ignore_patterns("out", "runs", "__pycache__")
    )
    summary_file = tmp_path / "summary.json"
    result = subprocess.run(
        [sys.executable, "-m", "pipejob.cli", "run", str(folder / manifest)],
        env=os.environ | {"PIPEJOB_SUMMARY_FILE": str(summary_file)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return json.loads(summary_file.read_text()), result.stdout, folder


# slow: the same example builds on the trainer image and trains in test_containers_e2e.py
@pytest.mark.slow
def test_custom_model_example(tmp_path: Path) -> None:
    summary, out, folder = run_example("custom-model", tmp_path)
    assert summary["model"] == "tinyvision.models:cnn"
    evaluation = summary["evaluation"]
    assert evaluation["accuracy"] > 0.8, evaluation  # four shapes: chance is 0.25
    sys.path.insert(0, str(folder))  # the example's package, as a user loads the model
    try:
        from tinyvision.models import cnn
    finally:
        sys.path.remove(str(folder))
    model = cnn(classes=4, width=16)
    model.load_state_dict(load_file(folder / "out" / "model.safetensors"), strict=True)
    info = json.loads((folder / "out" / "model.json").read_text())
    assert info["evaluation"] == evaluation
    assert isinstance(model(torch.zeros(2, 1, 32, 32)), torch.Tensor)


@pytest.mark.slow  # test_recipes.py: the schedule's values, a step's exactness, TensorBoard
def test_transformer_lm_example(tmp_path: Path) -> None:
    summary, out, folder = run_example("transformer-lm", tmp_path)
    losses = summary["losses"]
    assert sum(losses[-10:]) / 10 < losses[0] - 2, losses[::20]
    assert summary["evaluation"]["perplexity"] < 20, summary["evaluation"]
    assert (folder / "out" / "model.safetensors").exists()
    assert "eval step 100: loss " in out
    # Warmup, then cosine decay; clipped; its curves as TensorBoard's own reader sees them.
    assert summary["learningRates"][19] == pytest.approx(0.002)
    assert summary["learningRates"][-1] == pytest.approx(0.0002, rel=0.01)
    board = scalars(folder / "runs" / "transformer-lm")
    loss = board["train/loss"]
    assert sorted(loss) == list(range(1, 201)) and all(len(v) == 1 for v in loss.values())
    assert [loss[s][0] for s in range(1, 201)] == pytest.approx(losses, rel=1e-5)  # float32
    assert sorted(board["eval/perplexity"]) == [100, 200]


# slow: test_any_model.py's GPT-2 world holds a Hugging Face model trained and loaded back
@pytest.mark.slow
def test_hf_causal_lm_example(tmp_path: Path) -> None:
    """A raw Hugging Face GPT-2 (tied embeddings) in 4 stages: it learns, its held-out
    perplexity is reported, and its output folder is a model `from_pretrained` loads and
    `generate` runs."""
    from transformers import GPT2LMHeadModel

    summary, out, folder = run_example("hf-causal-lm", tmp_path)
    assert summary["stages"] == 4
    losses = summary["losses"]
    assert sum(losses[-10:]) / 10 < losses[0] - 1.5, losses[::25]  # from ln 256 = 5.5
    evaluation = summary["evaluation"]
    assert evaluation["perplexity"] < 40, evaluation
    assert evaluation["perplexity"] == pytest.approx(math.exp(evaluation["loss"]), rel=1e-3)
    model = GPT2LMHeadModel.from_pretrained(folder / "out").eval()
    state = load_file(folder / "out" / "model.safetensors")
    torch.testing.assert_close(model.lm_head.weight, model.transformer.wte.weight)  # still tied
    torch.testing.assert_close(model.transformer.wte.weight, state["transformer.wte.weight"])
    prompt = torch.tensor([list(b"def ")])
    generated = model.generate(prompt, max_new_tokens=16, do_sample=False)
    assert generated.shape == (1, 4 + 16)


def test_dlrm_example(tmp_path: Path) -> None:
    """The built-in DLRM on the shipped Criteo-format logs, its 26 tables on 2 parameter
    servers: it beats the click rate's own log loss on the held-out lines, reports AUC in
    its lines, summary and TensorBoard, and its model file, every table whole, gives the
    same AUC in a plain process."""
    summary, out, folder = run_example("dlrm", tmp_path, "hybridjob.yaml")
    train = CriteoLog(str(folder / "train.tsv"), "train")
    val = CriteoLog(str(folder / "val.tsv"), "val")
    rate = sum(train.sample(i)[2] for i in range(train.size)) / train.size
    labels = torch.tensor([float(val.sample(i)[2]) for i in range(val.size)])
    constant = F.binary_cross_entropy(torch.full_like(labels, rate), labels).item()
    assert summary["evalSamples"] == 250 and summary["evalStep"] == 75
    # Each trainer's reader held a shuffle window of the logs' lines at most (1000 here).
    assert all(
        0 < t["readerPeakBytes"] <= (folder / "train.tsv").stat().st_size
        for t in summary["perTrainer"].values()
    ), summary["perTrainer"]
    assert "lines the readers held at most: trainer0" in out
    assert summary["evalLoss"] < constant and summary["evalAuc"] > 0.65, (summary, constant)
    assert (
        f"eval step 75: loss {summary['evalLoss']:.4f}, AUC {summary['evalAuc']:.4f} on"
        " 250 held-out samples" in out
    )
    board = scalars(folder / "runs" / "dlrm")
    assert sorted(board["eval/auc"]) == [25, 50, 75]
    assert board["eval/auc"][75][0] == pytest.approx(summary["evalAuc"], rel=1e-6)

    job = spec.load(folder / "hybridjob.yaml").settings
    model = Recommender(job.embeddings, workloads.hybrid_dense(job, 13), 0, True)
    model.load_state_dict(load_file(folder / "out" / "model.safetensors"), strict=True)
    batch = samples.collate(val, list(range(val.size)), [f"C{i}" for i in range(1, 27)], True)
    features = sorted(batch.ids)
    with torch.no_grad():
        scores = model(batch.dense, batch.ids, {f: batch.offsets(f) for f in features})
    assert auc(scores, batch.labels) == pytest.approx(summary["evalAuc"], abs=1e-6)
    info = json.loads((folder / "out" / "model.json").read_text())
    assert [t["name"] for t in info["model"]["embeddings"]] == [f"C{i}" for i in range(1, 27)]
    assert info["metrics"]["evalAuc"] == summary["evalAuc"]
