"""A tensor subclass from the data on the traced path (issue 56, class 1): MONAI's
MetaTensor crosses between stages as one process has it, with its autograd link, and a
value that arrives without its link fails the step at once, naming why, instead of leaving
the stage before waiting for a gradient until the watchdog ends the job."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.rpc.internal import _internal_rpc_pickler
from userpkg.traced_cases import Tagged

from jobrun import pipeline_job, run_to_end
from pipejob.trainer.workloads.batch_values import dressed, undressed, unlinked

pytestmark = pytest.mark.timeout(60)


def crossed(value: object) -> tuple[object, int]:
    """`value` through torch's RPC pickler as a call's argument crosses to another process,
    and how many tensors it carried in its tensor table (those autograd links)."""
    payload, table = _internal_rpc_pickler.serialize(value)
    return _internal_rpc_pickler.deserialize(payload, table), len(table)


def test_a_tensor_subclass_crosses_as_itself_with_its_autograd_link():
    x = Tagged(torch.randn(2, 3), {"filename": "image0.nii"}).requires_grad_()
    y = x * 2  # a stage's output: a Tagged, computed
    arrived, carried = crossed((undressed(y),))
    assert carried == 1  # in the tensor table: torch's RPC records it for the backward
    (again,) = dressed(arrived)
    assert type(again) is Tagged and vars(again) == vars(y)
    assert type(dressed(undressed(x))) is Tagged and dressed(undressed(x)).meta == x.meta
    # Here, in one process, the round trip is a view: the gradient flows through it.
    (grad,) = torch.autograd.grad(dressed(undressed(y)).sum(), x)
    torch.testing.assert_close(grad, torch.full((2, 3), 2.0))


def test_a_value_that_lost_its_autograd_link_is_named():
    """As torch's RPC carries a subclass it is not told of: pickled inline, a leaf that
    needs a gradient no operation here made; the receiving stage refuses it at once."""
    y = Tagged(torch.randn(2, 3)).requires_grad_() * 2
    arrived, carried = crossed((y,))
    assert carried == 0
    assert unlinked(arrived) == "Tagged"


# A world: the in-process tests above hold the crossing and the refusal; this is the job
# that stalled at step 0 until the watchdog's 60 s (exit 6) before.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_on_tensor_subclass_data_trains(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # userpkg, in every process
    manifest = pipeline_job(
        "tagged",
        model={"import": "userpkg.traced_cases:small_cnn"},
        data={"import": "userpkg.traced_cases:tagged_images", "workers": 0},
        stages=2,
        microBatches=2,
        batchSize=8,
        steps=4,
        logEvery=2,
    )
    for key in ("imageSize", "numClasses"):  # the small pipeline's, for its resnet
        del manifest["spec"][key]
    code, output, summary = run_to_end(manifest, tmp_path, timeout=240)
    assert code == 0, output[-3000:]
    assert summary is not None and summary["steps"] == 4
