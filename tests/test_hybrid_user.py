"""HybridJob with the user's code and data (issue 12, item 6): a dense module by import path,
bags from .npz files or a Dataset, the loss by import path, held-out evaluation, and the
trained table and dense model written as files a plain process loads."""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from userpkg import bags as user

from jobrun import run_to_end
from pipejob.core import spec as specs
from pipejob.core.contract import ExitCode
from pipejob.trainer import workloads
from pipejob.trainer.hybrid.evaluate import check_dense
from pipejob.trainer.hybrid.model_writer import export_checkpoint
from pipejob.trainer.runtime import checkpoint
from pipejob.trainer.workloads import samples
from pipejob.trainer.workloads.bags import FileBags
from pipejob.trainer.workloads.samples import Batch, OneFeature, stream
from pipejob.trainer.workloads.synthetic import SyntheticBags

TESTS = Path(__file__).parent
ROWS, DIM, CLASSES = 64, 8, 4
MLP = {"dim": DIM, "hidden": 16, "classes": CLASSES}


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": name},
        "spec": {
            "trainers": 2,
            "embedding": {"numEmbeddings": ROWS, "dim": DIM, "mode": "sum"},
            "dense": {"outFeatures": CLASSES, "import": "userpkg.bags:mlp", "args": MLP},
            "steps": 60,
            "batchSize": 16,
            "seed": 5,
            "logEvery": 20,
            "optimizer": {"name": "adam", "lr": 0.02},
            "rendezvousTimeoutSeconds": 60,
            **spec,
        },
    }


def settings(tmp_path: Path, **spec: Any) -> Any:
    return specs.parse(manifest("unit", **spec)).settings


def in_order(bags: Any, batch_size: int, limit: int = 0) -> list[Batch]:
    """Bags in order, as batches of their one feature (what evaluation reads)."""
    return samples.in_order(OneFeature(bags, "ids"), batch_size, ["ids"], False, limit)


@pytest.fixture
def user_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs' processes import userpkg from tests/, whatever the runner adds itself."""
    paths = [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))


# ---------------------------------------------------------------------------- data


def test_a_file_in_the_one_line_format_reads_as_the_bags_it_holds(tmp_path: Path) -> None:
    path = str(tmp_path / "train.npz")
    np.savez(
        path, ids=np.array([3, 1, 4, 1, 5]), offsets=np.array([0, 2, 2]), labels=np.array([1, 0, 2])
    )
    data = FileBags(path, "spec.data.file.train", num_embeddings=6)
    assert data.size == 3
    assert [data.sample(i) for i in range(3)] == [([3, 1], 1), ([], 0), ([4, 1, 5], 2)]
    [batch] = in_order(data, batch_size=8)
    assert [t.tolist() for t in (batch.ids["ids"], batch.offsets("ids"), batch.labels)] == [
        [3, 1, 4, 1, 5],
        [0, 2, 2],
        [1, 0, 2],
    ]
    assert [b.labels.tolist() for b in in_order(data, 2)] == [[1, 0], [2]]
    assert len(in_order(data, 1, limit=2)) == 2


@pytest.mark.parametrize(
    ("arrays", "said"),
    [
        ({"ids": [1], "offsets": [0]}, "lacks the array(s) labels"),
        ({"ids": [1, 2], "offsets": [0, 3], "labels": [0, 1]}, "offsets must start at 0"),
        ({"ids": [1, 2], "offsets": [1], "labels": [0]}, "offsets must start at 0"),
        ({"ids": [1, 2, 3], "offsets": [0, 2, 1], "labels": [0, 1, 1]}, "never decrease"),
        ({"ids": [1, 6], "offsets": [0], "labels": [0]}, "id 6 is outside the table's rows 0..5"),
        ({"ids": [1, -1], "offsets": [0], "labels": [0]}, "id -1 is outside"),
        ({"ids": [1], "offsets": [0], "labels": [-2]}, "labels must be classes 0, 1, ..."),
        ({"ids": [], "offsets": [], "labels": []}, "holds no bags"),
        ({"ids": [1.5], "offsets": [0], "labels": [0]}, "ids must be a 1-d array of integers"),
        ({"ids": [1], "offsets": [0, 0], "labels": [0]}, "2 offsets but 1 labels"),
    ],
)
def test_a_bad_file_is_refused_on_load_naming_its_field(tmp_path: Path, arrays, said) -> None:
    path = str(tmp_path / "bad.npz")
    np.savez(path, **{k: np.array(v) for k, v in arrays.items()})
    with pytest.raises(ValueError, match=re.escape(said)) as e:
        FileBags(path, "spec.data.file.val", num_embeddings=6)
    assert str(e.value).startswith(f"spec.data.file.val: {path}")


def test_a_missing_or_foreign_file_names_its_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^spec.data.file.train: .*: no such file \(write it"):
        FileBags(str(tmp_path / "none.npz"), "spec.data.file.train", 6)
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(ValueError, match="^spec.data.file.train: .* is not an .npz file"):
        FileBags(str(tmp_path / "text.npz"), "spec.data.file.train", 6)


def test_data_by_import_gives_both_splits_and_checks_its_items(tmp_path: Path) -> None:
    args = {"rows": ROWS, "classes": CLASSES, "count": 50}
    spec = settings(tmp_path, data={"import": "userpkg.bags:dataset", "args": args})
    train, val = workloads.hybrid_data(spec), workloads.hybrid_held_out(spec)
    assert train.size == val.size == 50
    dense, sparse, label = train.sample(3)
    assert dense == () and all(isinstance(i, int) for i in sparse["ids"])
    assert isinstance(label, int)
    assert train.sample(3) != val.sample(3)  # another seed
    assert len(next(stream(train, 50, (1, 2), 0, ["ids"], False)).labels) == 25  # any bags
    small = settings(
        tmp_path,
        data={"import": "userpkg.bags:dataset", "args": args},
        embedding={"numEmbeddings": 3, "dim": DIM},
    )
    with pytest.raises(ValueError, match=r"^spec.data.import: item 0 of the train split: ids"):
        [workloads.hybrid_data(small).sample(i) for i in range(50)]


def test_synthetic_data_stays_the_default_with_a_held_out_set_of_another_seed(
    tmp_path: Path,
) -> None:
    spec = settings(tmp_path, datasetSize=500, bagSize=4)
    train, val = workloads.hybrid_data(spec), workloads.hybrid_held_out(spec)
    assert train.bags == SyntheticBags(
        size=500, num_embeddings=ROWS, classes=CLASSES, bag_size=4, seed=5
    )
    assert isinstance(val.bags, SyntheticBags) and val.size == 50
    assert [val.sample(i) for i in range(5)] != [train.sample(i) for i in range(5)]


# ---------------------------------------------------------------------------- model and loss


def test_the_loss_comes_from_an_import_with_its_args(tmp_path: Path) -> None:
    scores, labels = torch.randn(6, CLASSES), torch.tensor([0, 1, 2, 3, 2, 1])
    default = workloads.loss(settings(tmp_path))(scores, labels)
    torch.testing.assert_close(default, F.cross_entropy(scores, labels))
    spec = settings(
        tmp_path, loss={"import": "torch.nn:CrossEntropyLoss", "args": {"label_smoothing": 0.1}}
    )
    made = pickle.loads(pickle.dumps(workloads.loss(spec)))  # as it crosses RPC: by its words
    torch.testing.assert_close(
        made(scores, labels), F.cross_entropy(scores, labels, label_smoothing=0.1)
    )


def test_the_dense_module_is_checked_against_the_embeddings_and_the_labels(
    tmp_path: Path,
) -> None:
    spec = settings(tmp_path)
    dense = workloads.hybrid_dense(spec, dense_features=0)
    assert isinstance(dense, nn.Sequential)
    batch = in_order(
        SyntheticBags(size=32, num_embeddings=ROWS, classes=8, bag_size=3, seed=0), 32
    )[0]
    assert max(batch.labels) == 7
    cpu = torch.device("cpu")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "spec.dense.import: the dense module outputs (32, 4) but the labels (32,) go up"
            " to 7: IndexError"
        ),
    ):
        check_dense(spec, dense, F.cross_entropy, batch, cpu)
    narrow = settings(tmp_path, embedding={"numEmbeddings": ROWS, "dim": 5})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "spec.dense.import: the dense module fails on the bags' embeddings of shape"
            " (32, 5): RuntimeError: mat1 and mat2 shapes cannot be multiplied"
        ),
    ):
        check_dense(narrow, dense, F.cross_entropy, batch, cpu)
    fits = in_order(SyntheticBags(size=8, num_embeddings=ROWS, classes=4, bag_size=3, seed=0), 8)[0]
    check_dense(spec, dense, F.cross_entropy, fits, cpu)


# ---------------------------------------------------------------------------- whole runs


def plain_evaluation(out: Path, val: str) -> tuple[float, float]:
    """The held-out loss and accuracy of the written model, in this one plain process."""
    table = nn.EmbeddingBag(ROWS, DIM, mode="sum")
    table.load_state_dict(load_file(out / "table.safetensors"), strict=True)
    dense = user.mlp(**MLP)
    dense.load_state_dict(load_file(out / "dense.safetensors"), strict=True)
    data = np.load(val)
    with torch.no_grad():
        bags = table(torch.from_numpy(data["ids"]), torch.from_numpy(data["offsets"]))
        scores, labels = dense(bags), torch.from_numpy(data["labels"])
    loss = F.cross_entropy(scores, labels).item()
    return loss, int((scores.argmax(1) == labels).sum()) / len(labels)


@pytest.mark.timeout(240)
def test_a_user_dense_module_trains_on_file_data_and_its_output_loads(
    tmp_path: Path, user_path: None
) -> None:
    train, val = str(tmp_path / "train.npz"), str(tmp_path / "val.npz")
    user.write(train, ROWS, CLASSES, count=600, seed=1)
    user.write(val, ROWS, CLASSES, count=200, seed=2)
    out, ckpt = tmp_path / "model", tmp_path / "ckpt"
    job = manifest(
        "user-hybrid",
        data={"file": {"train": train, "val": val}},
        eval={"everySteps": 20},
        output={"path": str(out)},
        checkpoint={"path": str(ckpt), "everySteps": 60},
    )
    code, output, summary = run_to_end(job, tmp_path, timeout=210)
    assert code == 0, output
    assert summary is not None, output

    # It trained: the loss fell, and the held-out figures were reported as it went.
    assert summary["finalLoss"] < 0.5 * summary["firstLoss"], summary
    for step in (20, 40, 60):
        assert re.search(
            rf"^master\s*\| eval step {step}: loss [\d.]+, accuracy [\d.]+% on"
            r" 200 held-out bags$",
            output,
            re.M,
        ), output
    assert summary["evalStep"] == 60 and summary["evalSamples"] == 200
    assert summary["evalAccuracy"] > 0.7, summary  # chance is 0.25
    assert re.search(
        r"^master\s*\| held-out: loss [\d.]+, accuracy [\d.]+% on 200 bags"
        r" \(after step 60\)$",
        output,
        re.M,
    ), output
    assert summary["samplesRepeated"] == 0
    assert [t["share"] for t in summary["perTrainer"].values()] == [16, 16]
    wrote = r" table.safetensors, dense.safetensors, model.json$"
    assert re.search(
        rf"^master\s*\| wrote the trained model to {re.escape(str(out))}:{wrote}", output, re.M
    ), output

    # The files load strictly into plain modules and give the run's held-out figures.
    loss, accuracy = plain_evaluation(out, val)
    assert accuracy == pytest.approx(summary["evalAccuracy"], abs=1e-9)
    assert loss == pytest.approx(summary["evalLoss"], rel=1e-4)
    info = json.loads((out / "model.json").read_text())
    assert info["kind"] == "HybridJob" and info["steps"] == 60
    assert info["model"]["embedding"] == {"numEmbeddings": ROWS, "dim": DIM, "mode": "sum"}
    assert info["model"]["dense"]["import"] == "userpkg.bags:mlp"
    assert info["metrics"]["evalAccuracy"] == summary["evalAccuracy"]
    assert info["files"] == {"table": "table.safetensors", "dense": "dense.safetensors"}

    # The last checkpoint exports to the same model.
    found = checkpoint.latest(ckpt)
    assert found is not None and found.step == 60
    exported = tmp_path / "exported"
    export_checkpoint(found.directory, found.manifest, exported, "torch")
    for name in ("table", "dense"):
        got = torch.load(exported / f"{name}.pt", weights_only=True)
        expected = load_file(out / f"{name}.safetensors")
        assert sorted(got) == sorted(expected)
        for k, v in expected.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0)
    info = json.loads((exported / "model.json").read_text())
    assert info["model"]["embedding"]["mode"] == "sum" and info["steps"] == 60
    assert info["metrics"]["evalAccuracy"] == summary["evalAccuracy"]


@pytest.mark.slow  # test_user_model.py's failed import is the same permanent failure
@pytest.mark.timeout(150)
def test_a_dense_import_that_fails_in_the_pod_is_a_permanent_failure(
    tmp_path: Path, user_path: None
) -> None:
    job = manifest(
        "broken-dense",
        steps=2,
        preflight={"enabled": False},
        dense={"outFeatures": CLASSES, "import": "userpkg.missing:mlp"},
    )
    code, output, _ = run_to_end(job, tmp_path, timeout=120)
    assert code == ExitCode.PERMANENT, output
    assert re.search(
        r"^master\s*\| permanent: ImportFailed: .*spec\.dense\.import: cannot"
        r" import 'userpkg\.missing'",
        output,
        re.M,
    ), output
