"""A frozen weight tied between the first and last stages (LoRA over a tied embedding)
needs no gradient to combine (issue 56, class 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
from userpkg.traced_cases import frozen_tied_lm

from jobrun import check_gradients, pipeline_job
from pipejob.core import spec
from pipejob.trainer.workloads.cut import Traced, ties

pytestmark = pytest.mark.timeout(120)


def test_a_frozen_tied_weight_is_no_tie_to_combine():
    """Both stages hold the frozen embedding; nothing steps it, so its copies stay equal
    with no gradient summed (the step asked for one and failed before)."""
    model = frozen_tied_lm()
    traced = Traced(model)
    stages = traced.split(["norm"])
    holders = [{n for n, _ in s.named_parameters()} for s in stages]
    assert "embed.weight" in holders[0] and "embed.weight" in holders[-1]
    assert ties(stages) == []
    model.embed.weight.requires_grad_(True)  # trained, the tie is combined as before
    assert ties(stages) == [[(0, "embed.weight"), (1, "embed.weight")]]


# A world: the in-process test above holds the tie left out; this is the step itself.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_step_with_a_frozen_tied_embedding_is_one_process_step(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # userpkg for the processes
    job = spec.parse(
        pipeline_job(
            "frozen-tie",
            model={"import": "userpkg.traced_cases:frozen_tied_lm"},
            data={"import": "userpkg.brought:windows"},
            stages=2,
            microBatches=2,
            batchSize=4,
            splitPoints=["norm"],
            steps=1,
        )
    )
    check_gradients(job, tmp_path)
