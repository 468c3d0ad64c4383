"""Where a PipelineJob's data is read (issue 22: the master holds no input batch): through
`pipejob run`, a user's dataset records which process reads each sample. The first stage of
each replica reads its share of every training batch and replica 0's the held-out set; the
master reads only the two samples it checks the model's input with; no other stage reads."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

from jobrun import pipeline_job, run_to_end
from pipejob.trainer.workloads.data import StreamSampler

pytestmark = pytest.mark.timeout(300)
TESTS = Path(__file__).parent  # holds userpkg/, brought by `import:` as a user's package
BATCH, REPLICAS, ACCUMULATION, STEPS, SIZE = 4, 2, 2, 3, 40


def reads(folder: Path) -> dict[str, dict[str, list[int]]]:
    """Per reading process, per split, the sample indices it read, in order."""
    found: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for path in folder.glob("*.reads"):
        for line in path.read_text().split("\n")[:-1]:
            split, index = line.split()
            found[path.stem][split].append(int(index))
    return found


# slow: a replicated world: the replicas' step against one process's in test_replicas.py
@pytest.mark.slow
def test_each_replica_s_first_stage_reads_its_share_and_the_master_reads_no_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    )
    folder = tmp_path / "reads"
    folder.mkdir()
    job = pipeline_job(
        "reads",
        stages=2,
        replicas=REPLICAS,
        microBatches=2,
        batchSize=BATCH,
        steps=STEPS,
        gradientAccumulation=ACCUMULATION,
        imageSize=32,
        model="resnet18",
        data={
            "import": "userpkg.recorded:recorded",
            "args": {"folder": str(folder)},
            "workers": 0,
        },  # read in the first stage's own process: it counts them all
        eval={"everySteps": 2, "batches": 2},
    )
    code, output, summary = run_to_end(job, tmp_path, timeout=280)
    assert code == 0, output
    assert summary is not None and len(summary["losses"]) == STEPS, output
    got = reads(folder)

    whole = BATCH * REPLICAS  # a step's batches are `ACCUMULATION` of these
    order = StreamSampler(SIZE, whole, seed=0)  # the job's seed: the training order
    batches = [order.take(k * whole, whole) for k in range(STEPS * ACCUMULATION + 1)]
    opened = [0]  # opening a dataset reads its sample 0: is it an (input, label) pair?
    # The master checks the model's input on the first two samples of the order; nothing else.
    assert dict(got["master"]) == {"train": opened + order.take(0, 2)}, dict(got["master"])
    # Each first stage reads its share of every training batch, in order, and of one batch
    # ahead; replica 0's first measured the cut's costs on the first batch's samples.
    for r in range(REPLICAS):
        shares = [i for b in batches for i in b[r * BATCH : (r + 1) * BATCH]]
        measured = opened + order.take(0, BATCH) if r == 0 else []
        assert got[f"r{r}-stage0"]["train"] == measured + opened + shares, r
    # Replica 0's first stage reads the held-out set: its first 2 batches at steps 2 and 3.
    held = list(range(2 * whole))
    assert got["r0-stage0"]["val"] == opened + held + held
    assert set(got) == {"master", "r0-stage0", "r1-stage0"}, sorted(got)
    assert summary["evaluation"]["samples"] == 2 * whole
