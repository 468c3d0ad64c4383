"""spec.loss.crossEntropy (issue 58): the built-in cross-entropy's label smoothing and ignored
label, as F.cross_entropy computes them, and its refusals. tests/test_recipe_groups.py runs
it in a world (rpc-2-stages-label-smoothing-ignore-index): the loss crosses to the last stage."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from jobrun import pipeline_job
from pipejob.core import spec
from pipejob.trainer import workloads
from pipejob.trainer.workloads import label_loss, metrics


def loss_of(**loss: Any) -> workloads.Loss:
    return workloads.loss(spec.parse(pipeline_job("loss", loss=loss)).settings)


def test_the_options_are_f_cross_entropys_per_sample_and_per_token():
    made = loss_of(crossEntropy={"labelSmoothing": 0.2, "ignoreIndex": 0})
    assert made == label_loss.LabelLoss(0.2, 0) and made.ignore_index == 0
    assert pickle.loads(pickle.dumps(made)) == made  # it crosses RPC to the last stage
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 5, 7, dtype=torch.float64), torch.randint(7, (6, 5))
    want = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), label_smoothing=0.2, ignore_index=0
    )
    assert torch.equal(made(logits, labels), want)
    assert torch.equal(
        made({"logits": logits[:, 0]}, labels[:, 0]),
        F.cross_entropy(logits[:, 0], labels[:, 0], label_smoothing=0.2, ignore_index=0),
    )
    assert not torch.equal(made(logits, labels), metrics.cross_entropy(logits, labels))
    # Without the section: the built-in loss as before; with it empty, torch's defaults.
    assert loss_of() is metrics.cross_entropy
    assert loss_of(crossEntropy={}) == label_loss.LabelLoss(0.0, -100)


def refusals(manifest: dict[str, Any]) -> list[str]:
    with pytest.raises(spec.InvalidSpec) as refused:
        spec.parse(manifest)
    return [str(e) for e in refused.value.errors]


def test_bad_loss_options_are_refused_naming_the_field():
    ce = "spec.loss.crossEntropy"
    (smoothing,) = refusals(pipeline_job("bad", loss={"crossEntropy": {"labelSmoothing": 1.5}}))
    assert smoothing.startswith(f"{ce}.labelSmoothing: must be <= 1")
    (index,) = refusals(pipeline_job("bad", loss={"crossEntropy": {"ignoreIndex": 0.5}}))
    assert index.startswith(f"{ce}.ignoreIndex: ")
    (both,) = refusals(
        pipeline_job("bad", loss={"import": "torch.nn:CrossEntropyLoss", "crossEntropy": {}})
    )
    assert both.startswith(f"{ce}: crossEntropy sets the built-in loss's options")
    (unknown,) = refusals(pipeline_job("bad", loss={"crossEntropy": {"smoothing": 0.1}}))
    assert unknown.startswith(f"{ce}.smoothing: unknown field")
    clicks = {
        "apiVersion": spec.API_VERSION,
        "kind": "HybridJob",
        "metadata": {"name": "bad"},
        "spec": {
            "embeddings": [{"name": "a", "rows": 10, "dim": 4}],
            "loss": {"crossEntropy": {"labelSmoothing": 0.1}},
        },
    }
    assert refusals(clicks) == [
        f"{ce}: a click (spec.embeddings) is judged by binary cross-entropy: loss.crossEntropy's"
        " options are for class labels; leave it out"
    ]
