"""The examples that bring their own code run with `pipejob run` as they are (copied to a
temporary folder, so their outputs land there), and learn."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.timeout(300)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, tmp_path: Path) -> tuple[dict, str, Path]:
    folder = tmp_path / name
    shutil.copytree(EXAMPLES / name, folder, ignore=shutil.ignore_patterns("out", "__pycache__"))
    summary_file = tmp_path / "summary.json"
    result = subprocess.run(
        [sys.executable, "-m", "pipejob.cli", "run", str(folder / "pipelinejob.yaml")],
        env=os.environ | {"PIPEJOB_SUMMARY_FILE": str(summary_file)}, cwd=tmp_path,
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return json.loads(summary_file.read_text()), result.stdout, folder


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


def test_transformer_lm_example(tmp_path: Path) -> None:
    summary, out, folder = run_example("transformer-lm", tmp_path)
    losses = summary["losses"]
    assert sum(losses[-10:]) / 10 < losses[0] - 2, losses[::20]
    assert summary["evaluation"]["perplexity"] < 20, summary["evaluation"]
    assert (folder / "out" / "model.safetensors").exists()
    assert "eval step 100: loss " in out
