"""Data as one process sees it on the traced path (issue 56): dict inputs and dict labels
pass the master's fit check and reach the stages as dicts (class 8)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from userpkg.traced_cases import DictInputs, dict_label_loss

from jobrun import pipeline_job, run_to_end
from pipejob.trainer.pipeline.reader import Reader
from pipejob.trainer.pipeline.shape_check import fits_model
from pipejob.trainer.workloads.cut import Traced

pytestmark = pytest.mark.timeout(60)


def batch(n: int = 6, width: int = 8) -> tuple[dict, dict]:
    torch.manual_seed(0)
    inputs = {"features": torch.randn(n, width), "tokens": torch.randint(0, 11, (n, 5))}
    return inputs, {"cls": torch.randint(0, 3, (n,))}


def on_meta() -> DictInputs:
    """The model as the master builds it: on the meta device (models.build_meta)."""
    with torch.device("meta"):
        return DictInputs()


def test_dict_inputs_and_labels_pass_the_fit_check():
    inputs, labels = batch()
    assert fits_model(on_meta(), inputs, labels, dict_label_loss) is None


def test_dict_inputs_that_do_not_fit_are_refused_naming_them():
    inputs, labels = batch(width=5)
    with pytest.raises(ValueError, match=r"inputs of shape \{'features': \(2, 5\) float32"):
        fits_model(on_meta(), inputs, labels, dict_label_loss)


def test_the_stages_read_and_compute_dict_inputs_as_one_process():
    """The first stage's reader splits each of the dict's tensors by micro-batch; the stages
    of the cut compute on those dicts what the model computes on them."""
    inputs, labels = batch()
    reader = Reader(None, torch.device("cpu"))
    assert reader.read(0, 3, given=(inputs, labels)) == 6
    model = DictInputs()
    stages = Traced(model).split(["mix"])
    for mb in range(3):
        (x,) = reader.input(0, mb)
        assert sorted(x) == ["features", "tokens"] and len(x["tokens"]) == 2
        passed = stages[0](x)
        got = stages[1](*passed) if isinstance(passed, tuple) else stages[1](passed)
        torch.testing.assert_close(got, model(x))
    assert reader.labels(0)["cls"].shape == (6,)


# A world: the in-process tests above hold the fit check, the reader and the stages' compute.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_of_dict_inputs_and_labels_trains(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # userpkg, in every process
    manifest = pipeline_job(
        "dicts",
        model={"import": "userpkg.traced_cases:dict_inputs"},
        data={"import": "userpkg.traced_cases:dict_data", "workers": 0},
        loss={"import": "userpkg.traced_cases:dict_labels"},
        eval={"everySteps": 0},
        stages=2,
        microBatches=2,
        batchSize=16,
        steps=4,
        logEvery=2,
    )
    for key in ("imageSize", "numClasses"):  # the small pipeline's, for its resnet
        del manifest["spec"][key]
    code, output, summary = run_to_end(manifest, tmp_path, timeout=240)
    assert code == 0, output[-3000:]
    assert "samples of shape {'features': (8,) float32, 'tokens': (5,) int64}" in output
    assert summary is not None and summary["steps"] == 4
