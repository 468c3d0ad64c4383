"""A user's model on a user's data, end to end: scikit-learn's real digits as an ImageFolder of
PNGs, a small CNN from an `import:` factory in a user's package, through the unmodified
operator on the emulated cluster (its pods are real processes); the held-out accuracy in the
summary and the job's status; the one model file out, loaded by a plain process; and the
same model exported from the job's checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchvision import datasets, transforms
from userdata import write_digits
from userpkg.vision import small_cnn

from harness import jobs
from jobrun import pipeline_job, run_to_end
from pipejob.core.contract import ExitCode

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).parent  # holds userpkg/: on the pods' PYTHONPATH through the template
NS, KIND = "default", "PipelineJob"
STEPS = 150


def plain_accuracy(model: torch.nn.Module, folder: Path) -> float:
    """Held-out accuracy in this one process, with the standard transforms written out."""
    standard = transforms.Compose(
        [
            transforms.Resize(32),
            transforms.CenterCrop(32),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    held = datasets.ImageFolder(str(folder), standard)
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(held, batch_size=128):
            correct += int((model(x).argmax(1) == y).sum())
    return correct / len(held)


# slow: the custom model example, a user's package, trains in containers in test_containers_e2e.py
@pytest.mark.slow
def test_digits_cnn_from_a_users_package_learns_and_its_model_loads(
    cluster, kubelet, operator, tmp_path
):
    api = cluster.api
    train, val = write_digits(tmp_path / "digits")
    out, ckpt = tmp_path / "model", tmp_path / "checkpoints"
    manifest = {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": KIND,
        "metadata": {"name": "digits"},
        "spec": {
            "model": {"import": "userpkg.vision:small_cnn", "args": {"classes": 10}},
            "loss": {"import": "userpkg.vision:smoothed", "args": {"smoothing": 0.05}},
            "data": {"imageFolder": {"train": str(train), "val": str(val)}, "workers": 2},
            "eval": {"everySteps": 75},
            "output": {"path": str(out)},
            "stages": 2,
            "imageSize": 32,
            "batchSize": 64,
            "microBatches": 4,
            "numClasses": 10,
            "steps": STEPS,
            "logEvery": 25,
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "preflight": {"megabytes": 0.25},
            "checkpoint": {"path": str(ckpt), "everySteps": 75, "volume": "ckpt"},
            "template": {
                "env": [{"name": "PYTHONPATH", "value": str(TESTS)}],
                "volumes": [
                    {"name": "ckpt", "hostPath": {"path": str(ckpt), "type": "DirectoryOrCreate"}}
                ],
            },
        },
    }
    jobs.create(api, manifest)
    done = jobs.wait_phase(api, KIND, "digits", "Succeeded", timeout=240)
    training = done["status"]["training"]
    assert training["evalStep"] == STEPS
    assert training["evalAccuracy"] >= 0.9, training
    log = kubelet.logs(NS, "digits-master-0")
    assert "eval step 75: loss " in log and f"eval step {STEPS}: loss " in log
    summary_line = f"held-out after step {STEPS}: loss {training['evalLoss']:.4f}, accuracy"
    assert summary_line in log, log[-3000:]

    # One file under the model's own names: the factory's fresh model loads it strictly and
    # gives the same held-out accuracy in one plain process.
    info = json.loads((out / "model.json").read_text())
    assert info["model"] == manifest["spec"]["model"] and info["format"] == "safetensors"
    assert info["evaluation"]["accuracy"] == pytest.approx(training["evalAccuracy"], abs=1e-6)
    model = small_cnn(classes=10)
    model.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    assert plain_accuracy(model, val) == pytest.approx(training["evalAccuracy"], abs=1e-6)

    # `pipejob export` writes the same model from the last checkpoint (step 150).
    exported = tmp_path / "exported"
    result = subprocess.run(
        [sys.executable, "-m", "pipejob.cli", "export", str(ckpt), str(exported)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"wrote {exported / 'model.safetensors'}" in result.stdout
    again, final = load_file(exported / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(again) == sorted(final)
    assert all(torch.equal(again[k], final[k]) for k in final)
    assert json.loads((exported / "model.json").read_text())["steps"] == STEPS


# ------------------------------------------------------------ what fails, fails at once


# Each case is a world: `make test` runs a factory that cannot be imported and data that does
# not fit; a factory's own error, too many stages and an untraceable forward are `slow` (the
# same permanent failure path; test_cut.py and test_refusals.py hold their messages in process).
@pytest.mark.parametrize(
    "fields,says",
    [
        (
            {"model": {"import": "userpkg.missing:build"}},
            "permanent: ImportFailed: training failed: ImportError: spec.model.import:"
            " cannot import 'userpkg.missing' (from 'userpkg.missing:build'): ModuleNotFoundError",
        ),
        pytest.param(
            {"model": {"import": "userpkg.vision:broken"}},
            "spec.model.import: 'userpkg.vision:broken' raised RuntimeError: the factory's own bug",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"model": {"import": "userpkg.vision:two_layers"}, "stages": 3},
            "the model has 2 places to cut; it can fill at most 2 stages, not 3",
            marks=pytest.mark.slow,
        ),
        (
            {"model": {"import": "userpkg.vision:small_cnn"}, "imageSize": 48},
            "spec.data: inputs of shape (2, 3, 48, 48) float32 do not fit spec.model",
        ),
        pytest.param(
            {"model": {"import": "userpkg.brought:branchy"}},
            "spec.model userpkg.brought:branchy with 2 stages: cannot trace Branchy's"
            " forward between its modules: TraceError: symbolically traced variables"
            " cannot be used as inputs to control flow at brought.py:",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_job_that_cannot_train_fails_permanently_saying_why(fields, says, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    job = pipeline_job("refused", **{"steps": 2, **fields})
    code, out, _ = run_to_end(job, tmp_path, timeout=120)
    assert code == ExitCode.PERMANENT, out
    assert says in out, out[-3000:]
