"""Models from real libraries, written as their users write them (tests/userpkg/*_models.py),
trained as jobs: `pipejob run` in 2 stages on whatever path `cut: auto` picks, one SGD step,
its output loaded as a user loads it and held against the same step in one process: the
step-1 loss and every gradient within float32's noise (issue 56's acceptance). Each needs its
library (benchmarks/requirements-libraries.txt: `pip install --no-deps --target DIR`, then
DIR on PYTHONPATH); where it is absent the test skips, naming it. What each fix holds without
the library is in the fast tests beside it (test_traced_subclass, test_traced_libraries,
test_traced_outputs, test_library_standins)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from one_process import assert_output_is_the_step, first_step
from test_eager import resumed_as_straight

from jobrun import pipeline_job, run_to_end

pytestmark = pytest.mark.timeout(900)

TESTS = Path(__file__).parent
LR = 1.0
# Float32's noise on a gradient, relative to its scale: the stages add the same terms as one
# process, in another order where a weight is shared (benchmarks/_conform.py's bound).
TOLERANCE = 1e3 * 1.1920928955078125e-07

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "monai UNet on MetaTensors": (
        "monai",
        {
            "model": {"import": "userpkg.monai_models:unet"},
            "data": {"import": "userpkg.monai_models:segmentation"},
            "loss": {"import": "userpkg.monai_models:dice_loss"},
        },
    ),
    "monai DynUNet, deep supervision": (
        "monai",
        {
            "model": {"import": "userpkg.monai_models:dynunet"},
            "data": {"import": "userpkg.monai_models:segmentation"},
            "loss": {"import": "userpkg.monai_models:deep_supervision_loss"},
        },
    ),
    "kornia gaussian_blur2d": (
        "kornia",
        {"model": {"import": "userpkg.kornia_models:blurred"}, "imageSize": 32, "numClasses": 10},
    ),
    "torchtune Llama 3.2, LoRA, tied": (
        "torchtune",
        {
            "model": {"import": "userpkg.torchtune_models:lora_llama"},
            "data": {"tokens": {"train": "TOKENS", "seqLen": 16}},
        },
    ),
    "fair-esm ESM-2": (
        "esm",
        {
            "model": {"import": "userpkg.esm_models:esm2"},
            "data": {"import": "userpkg.esm_models:proteins"},
        },
    ),
    "pytorch-tabnet TabNet": (
        "pytorch_tabnet",
        {
            "model": {"import": "userpkg.tabnet_models:tabnet"},
            "data": {"import": "userpkg.tabnet_models:table"},
            "loss": {"import": "userpkg.tabnet_models:tabnet_loss"},
        },
    ),
}


def library_path(library: str) -> str:
    """The folder the library is imported from (a --target folder, or site-packages); the
    test skips, naming the library, where it is not installed."""
    found = importlib.util.find_spec(library)
    if found is None:
        pytest.skip(f"{library} is not installed (benchmarks/requirements-libraries.txt)")
    folder = found.origin or next(iter(found.submodule_search_locations or []))  # a namespace
    return str(Path(folder).parents[0 if found.origin is None else 1])


def job(name: str, tmp_path: Path) -> dict[str, Any]:
    fields = CASES[name][1]
    if "tokens" in fields.get("data", {}):
        tokens = tmp_path / "tokens.bin"
        np.array([i % 64 for i in range(4096)], dtype=np.uint16).tofile(tokens)
        fields = fields | {"data": {"tokens": {"train": str(tokens), "seqLen": 16}}}
    manifest = pipeline_job(
        name.split()[0].lower().replace("-", ""),
        stages=2,
        microBatches=2,
        batchSize=8,
        steps=1,
        optimizer={"name": "sgd", "lr": LR, "momentum": 0},
        eval={"everySteps": 0},
        output={"path": str(tmp_path / "out")},
        **fields,
    )
    for key in ("imageSize", "numClasses"):  # the small pipeline's, for its resnet
        if key not in fields:
            del manifest["spec"][key]
    return manifest


def trains_as_one_process(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The job's first step against one process's; the summary, for what the case adds."""
    monkeypatch.setenv("PYTHONPATH", f"{TESTS}:{library_path(CASES[name][0])}")
    monkeypatch.syspath_prepend(library_path(CASES[name][0]))
    manifest = job(name, tmp_path)
    code, output, summary = run_to_end(manifest, tmp_path, timeout=360)
    assert code == 0, output[-4000:]
    assert summary is not None and summary["steps"] == 1, summary
    step = first_step(manifest, LR)
    assert_output_is_the_step(tmp_path / "out", summary, step, LR, TOLERANCE)
    return summary


def test_tabnets_logits_and_sparsity_loss_train_as_one_process(tmp_path, monkeypatch):
    trains_as_one_process("pytorch-tabnet TabNet", tmp_path, monkeypatch)


# A world each; TabNet's above holds the check itself, each of these a library's own model.
@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [n for n in CASES if not n.startswith("pytorch-tabnet")],
)
def test_a_library_model_trains_in_two_stages_as_one_process(name, tmp_path, monkeypatch):
    trains_as_one_process(name, tmp_path, monkeypatch)


@pytest.mark.slow  # two worlds; the stand-in's resume: test_eager.py (no MONAI)
def test_dynunet_resumes_on_the_eager_path_to_the_bit(tmp_path, monkeypatch):
    """MONAI's DynUNet takes the eager path by itself (its input_block is also its skip
    layers' downsample; a kept skip layer writes the deep-supervision heads): Adam, steps
    3-4 resumed from the step-2 checkpoint give a straight run's losses and trained model
    to the bit, the module under both its names."""
    name = "monai DynUNet, deep supervision"
    monkeypatch.setenv("PYTHONPATH", f"{TESTS}:{library_path(CASES[name][0])}")

    def resumable(root: Path, out: Path) -> dict[str, Any]:
        manifest = job(name, tmp_path)
        manifest["spec"] |= {
            "steps": 4,
            "optimizer": {"name": "adam", "lr": 0.01},
            "checkpoint": {"path": str(root), "everySteps": 2},
            "output": {"path": str(out)},
        }
        return manifest

    straight, _, trained = resumed_as_straight(resumable, tmp_path, timeout=420)
    assert straight["path"] == "eager", straight
    assert torch.equal(
        trained["input_block.conv1.conv.weight"],
        trained["skip_layers.downsample.conv1.conv.weight"],
    )
