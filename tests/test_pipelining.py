"""The pipelining engine (spec.engine: pipelining): every torch schedule pipejob offers
computes one process's loss and gradients (float64, as jobrun.check_gradients), for the
transformer language model, ResNet-50 and a model whose tied weight the cut separates, in 2
to 4 stage processes, with replicas; each world runs every schedule on the same processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from userdata import BYTE_VOCAB, write_stdlib_tokens

from jobrun import check_gradients, pipeline_job
from pipejob.core import spec

pytestmark = pytest.mark.timeout(400)

# As PipelineSpec fields: one stage per process, or two (the interleaved schedules).
SCHEDULES = [
    {"schedule": "gpipe", "stages_per_process": 1},
    {"schedule": "1f1b", "stages_per_process": 1},
    {"schedule": "interleaved-1f1b", "stages_per_process": 2},
    {"schedule": "zero-bubble", "stages_per_process": 2},
]
TRANSFORMER = {"vocabSize": BYTE_VOCAB, "layers": 3, "width": 32, "heads": 2, "seqLen": 32}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("stdlib-bytes") / "train.bin"
    write_stdlib_tokens(path, max_bytes=100_000)
    return str(path)


WORLDS: dict[str, tuple[dict[str, Any], int, int]] = {
    # name: the job's fields, stage processes, replicas
    "transformer": ({"model": {"transformer": TRANSFORMER}, "batchSize": 8, "microBatches": 2},
                    2, 2),
    "resnet50": ({"model": "resnet50", "batchSize": 8, "microBatches": 4}, 2, 1),
    "resnet18-4-stages": ({"model": "resnet18", "batchSize": 8, "microBatches": 4}, 4, 1),
    "tied-3-stages": ({"model": {"import": "userpkg.tied:tied_lm"},
                       "data": {"import": "userpkg.brought:windows"}, "batchSize": 6,
                       "microBatches": 3}, 3, 1),
}  # fmt: skip


@pytest.mark.parametrize("name", list(WORLDS))
def test_every_schedule_computes_one_process_gradients(name: str, tokens: str, tmp_path: Path,
                                                       monkeypatch) -> None:  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # userpkg for the processes
    fields, stages, replicas = WORLDS[name]
    if "transformer" in fields["model"]:
        fields = fields | {"data": {"tokens": {"train": tokens}, "workers": 1}}
    job = spec.parse(pipeline_job(f"pipelining-{name}", engine="pipelining", stages=stages,
                                  replicas=replicas, steps=1, **fields))  # fmt: skip
    got = check_gradients(job, tmp_path, timeout=360, schedules=SCHEDULES)
    assert len(got["stages"]) == 2 * stages  # the last schedule's pieces: two per process
