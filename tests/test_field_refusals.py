"""The fields added since the first refusals (tables, the sparse optimizer, Criteo data,
output, elastic sizes), each mistake found by hand in issue 43: refused in one line naming
the field, by `pipejob validate` and `render` alike, with no traceback. The fuzzer
(tests/test_fuzz.py) looks for the next ones."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipejob.cli import main as cli
from pipejob.core import spec
from pipejob.core.spec import InvalidSpec

ROOT = Path(__file__).resolve().parents[1]
DLRM = yaml.safe_load((ROOT / "examples/dlrm/hybridjob.yaml").read_text())
HYBRID = yaml.safe_load((ROOT / "examples/hybrid.yaml").read_text())
PIPELINE = yaml.safe_load((ROOT / "examples/resnet50-pipeline.yaml").read_text())


def changed(base: dict, **fields: Any) -> dict:
    """`base` with `fields` set in its spec (None: left out)."""
    manifest = copy.deepcopy(base)
    manifest["spec"].update(fields)
    manifest["spec"] = {k: v for k, v in manifest["spec"].items() if v is not None}
    return manifest


def refusal(manifest: dict) -> list[str]:
    with pytest.raises(InvalidSpec) as e:
        spec.parse(manifest)
    return [str(error) for error in e.value.errors]


CASES = [
    (changed(HYBRID, embedding=None, embeddings=[]), "spec.embeddings: must hold at least 1"),
    (
        changed(DLRM, sparseOptimizer={"name": "adam", "beta2": 1.0}),
        "spec.sparseOptimizer.beta2: must be < 1",
    ),
    (
        changed(DLRM, sparseOptimizer={"name": "adam", "beta1": -0.1}),
        "spec.sparseOptimizer.beta1: must be >= 0",
    ),
    (
        changed(DLRM, sparseOptimizer={"name": "adam", "eps": 0}),
        "spec.sparseOptimizer.eps: eps must be > 0 with adam",
    ),
    (
        changed(DLRM, sparseOptimizer={"name": "adagrad", "eps": -1e-9}),
        "spec.sparseOptimizer.eps: must be >= 0",
    ),
    (
        changed(DLRM, sparseOptimizer={"name": "adagrad", "initialAccumulatorValue": -1}),
        "spec.sparseOptimizer.initialAccumulatorValue: must be >= 0",
    ),
    (
        changed(DLRM, optimizer={"name": "rmsprop", "lr": 0.1, "weightDecay": -0.5}),
        "spec.optimizer.weightDecay: must be >= 0",
    ),
    (changed(DLRM, data={"criteo": {"train": ""}}), "spec.data.criteo.train: must name"),
    (
        changed(DLRM, data={"criteo": {"train": "t.tsv", "val": "  "}}),
        "spec.data.criteo.val: must name",
    ),
    (changed(DLRM, output={"path": ""}), "spec.output.path: must name a directory"),
    (changed(PIPELINE, output={"path": ""}), "spec.output.path: must name a directory"),
    (
        changed(PIPELINE, data={"imageFolder": {"train": ""}}),
        "spec.data.imageFolder.train: must name",
    ),
    (
        changed(PIPELINE, replicas=2, elastic={"pendingSeconds": 30}),
        "spec.elastic: acts only on a world whose replicas is a range",
    ),
    (
        changed(HYBRID, elastic={"pendingSeconds": 30}),
        "spec.elastic: acts only on a world whose trainers is a range",
    ),
    (
        changed(
            PIPELINE,
            checkpoint={"path": "/c"},
            replicas={"min": 2, "max": 2},
            elastic={"pendingSeconds": 30},
        ),
        "spec.elastic: acts only",
    ),
]


@pytest.mark.parametrize(("manifest", "said"), CASES)
def test_each_mistake_is_refused_naming_its_field(manifest: dict, said: str) -> None:
    errors = refusal(manifest)
    assert any(e.startswith(said) for e in errors), errors
    assert all("\n" not in e for e in errors)


def test_an_elastic_section_on_a_range_is_kept() -> None:
    job = spec.parse(
        changed(
            PIPELINE,
            checkpoint={"path": "/c"},
            replicas={"min": 1, "max": 2},
            elastic={"pendingSeconds": 30},
        )
    )
    assert job.spec["elastic"] == {"pendingSeconds": 30}


def test_empty_tables_are_refused_by_validate_and_render_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(changed(HYBRID, embedding=None, embeddings=[])))
    for verb in ("validate", "plan", "render"):
        with pytest.raises(SystemExit) as e:
            raise SystemExit(cli.main([verb, str(path)]))
        assert e.value.code == 2, verb
        err = capsys.readouterr().err
        assert "Traceback" not in err and "spec.embeddings: must hold at least 1" in err


@pytest.mark.parametrize(
    ("kind", "wrong", "nearest"),
    [
        (PIPELINE, "stagesPerProces", "did you mean 'stagesPerProcess'?"),
        (PIPELINE, "StagesPerProcess", "did you mean 'stagesPerProcess'"),
        (HYBRID, "sparseOptimiser", "did you mean 'sparseOptimizer'"),
    ],
)
def test_an_unknown_field_names_at_most_three_near_ones(
    kind: dict, wrong: str, nearest: str
) -> None:
    (error,) = refusal(changed(kind, **{wrong: 1}))
    assert error.startswith(f"spec.{wrong}: unknown field") and nearest in error
    assert error.count("'") <= 6 and len(error) < 160, error  # three names at most


def test_an_unknown_field_near_nothing_says_so_briefly() -> None:
    (error,) = refusal(changed(HYBRID, zzzzqqq=1))
    assert "none known is close" in error and len(error) < 160


def test_the_trainer_count_message_names_the_count_it_used() -> None:
    elastic = changed(
        HYBRID, trainers={"min": 1, "max": 8}, datasetSize=100, checkpoint={"path": "/c"}
    )
    (error,) = refusal(elastic)
    assert "trainers.max x batchSize = 256 samples, got 100" in error
    (error,) = refusal(changed(HYBRID, trainers=8, datasetSize=100))
    assert "one batch per trainer: trainers x batchSize = 256 samples, got 100" in error
