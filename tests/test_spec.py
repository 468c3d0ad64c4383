"""Manifests are defaulted, and every mistake is refused with its field path and reason."""

import copy

import pytest

from pipejob.core import spec


def pipeline(**overrides):
    m = {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": "resnet"},
        "spec": {"stages": 2, "microBatches": 4, "batchSize": 32},
    }
    m["spec"].update(overrides)
    return m


def hybrid(**overrides):
    m = {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": "recsys"},
        "spec": {"trainers": 2},
    }
    m["spec"].update(overrides)
    return m


def test_defaults_fill_every_field():
    job = spec.parse(pipeline())
    s = job.spec
    assert (job.kind, job.name) == ("PipelineJob", "resnet")
    assert s["model"] == "resnet50" and s["steps"] == 10 and s["imageSize"] == 224
    assert s["optimizer"] == {"name": "sgd", "lr": 0.05, "momentum": 0.0, "weightDecay": 0.0}
    assert s["backoffLimit"] == 3 and s["gpusPerStage"] == 0 and s["suspend"] is False
    assert "template" not in s and "activeDeadlineSeconds" not in s


@pytest.mark.parametrize(
    ("gpus", "backend"), [(0, "gloo"), (1, "nccl")], ids=["cpu-gloo", "gpu-nccl"]
)
def test_hybrid_backend_follows_gpus(gpus, backend):
    assert spec.parse(hybrid(gpusPerTrainer=gpus)).spec["backend"] == backend


def test_micro_batches_is_a_count_or_auto():
    assert spec.parse(_with(pipeline(), "spec.microBatches", _DELETE)).spec["microBatches"] == 4
    assert spec.parse(pipeline(microBatches=8)).spec["microBatches"] == 8
    # auto picks a count that divides the batch itself: any batch size is accepted.
    assert spec.parse(pipeline(microBatches="auto", batchSize=30)).spec["microBatches"] == "auto"


def test_explicit_gloo_with_gpus_is_kept():
    assert spec.parse(hybrid(gpusPerTrainer=1, backend="gloo")).spec["backend"] == "gloo"


def _with(base, path, value):
    m = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = m
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return m


_DELETE = object()

MISTAKES = [
    # (manifest, path the error names, words in the reason)
    (_with(pipeline(), "apiVersion", "pipejob.dev/v1"), "apiVersion", "must be pipejob.dev/v1alpha1"),  # noqa: E501
    (_with(pipeline(), "kind", "PipeJob"), "kind", "must be one of PipelineJob, HybridJob"),
    (_with(pipeline(), "metadata", _DELETE), "metadata", "is required"),
    (_with(pipeline(), "metadata.name", "ResNet_50"), "metadata.name", "DNS label"),
    (_with(pipeline(), "metadata.name", "a" * 41), "metadata.name", "at most 40"),
    (pipeline(stages=1), "spec.stages", ">= 2"),
    (pipeline(stages="two"), "spec.stages", "must be an integer"),
    (pipeline(stages=True), "spec.stages", "must be an integer"),
    (pipeline(microBatchs=4), "spec.microBatchs", "did you mean 'microBatches'"),
    (pipeline(batchSize=30, microBatches=4), "spec.microBatches", "divisible by microBatches"),
    (pipeline(batchSize=32, microBatches=3), "spec.microBatches", "divisible by microBatches"),
    (pipeline(microBatches=0), "spec.microBatches", "must be >= 1, got 0"),
    (pipeline(microBatches="Auto"), "spec.microBatches",
     "must be an integer or a string matching auto, got 'Auto'"),
    (pipeline(microBatches="4"), "spec.microBatches", "an integer is written without quotes"),
    (pipeline(microBatches=2.5), "spec.microBatches", "must be an integer or a string, got 2.5"),
    (pipeline(microBatches=True), "spec.microBatches", "must be an integer or a string"),
    (pipeline(model="resnet9000"), "spec.model", "must be one of"),
    (pipeline(imageSize=16), "spec.imageSize", ">= 32"),
    (pipeline(gpusPerStage=-1), "spec.gpusPerStage", ">= 0"),
    (pipeline(optimizer={"lr": 0}), "spec.optimizer.lr", "> 0"),
    (pipeline(optimizer={"name": "lbfgs"}), "spec.optimizer.name", "must be one of"),
    (pipeline(optimizer={"momentum": 1.5}), "spec.optimizer.momentum", "<= 1"),
    (pipeline(optimizer="sgd"), "spec.optimizer", "must be a mapping"),
    (pipeline(template={"imagePullPolicy": "Sometimes"}), "spec.template.imagePullPolicy",
     "must be one of"),
    (pipeline(template={"nodeSelector": {"gpu": 1}}), "spec.template.nodeSelector.gpu",
     "must be a string"),
    (pipeline(template={"tolerations": {"key": "x"}}), "spec.template.tolerations",
     "must be a list"),
    (pipeline(suspend="yes"), "spec.suspend", "true or false"),
    (pipeline(activeDeadlineSeconds=0), "spec.activeDeadlineSeconds", ">= 1"),
    (_with(pipeline(), "spec", ["stages"]), "spec", "must be a mapping"),
    (_with(pipeline(), "extra", 1), "extra", "unknown top-level field"),
    (hybrid(trainers=0), "spec.trainers", ">= 1"),
    (hybrid(backend="nccl"), "spec.backend", "needs gpusPerTrainer > 0"),
    (hybrid(backend="mpi"), "spec.backend", "must be one of gloo, nccl"),
    (hybrid(embedding={"mode": "median"}), "spec.embedding.mode", "must be one of"),
    (hybrid(embedding={"dims": 8}), "spec.embedding.dims", "did you mean 'dim'"),
    (hybrid(dense={"outFeatures": 1}), "spec.dense.outFeatures", ">= 2"),
    (hybrid(datasetSize=10, batchSize=8), "spec.datasetSize", "at least one batch per trainer"),
    (hybrid(stages=2), "spec.stages", "unknown field"),
]  # fmt: skip


@pytest.mark.parametrize(("manifest", "path", "words"), MISTAKES, ids=[m[1] for m in MISTAKES])
def test_mistake_is_refused_with_its_path(manifest, path, words):
    with pytest.raises(spec.InvalidSpec) as caught:
        spec.parse(manifest, "job.yaml")
    found = {e.path: e.reason for e in caught.value.errors}
    assert path in found, f"no error at {path}: {found}"
    assert words in found[path]
    assert str(caught.value).startswith("job.yaml: invalid job:")


def test_every_mistake_is_reported_at_once():
    bad = pipeline(stages=0, steps=0, microBatchs=2)
    with pytest.raises(spec.InvalidSpec) as caught:
        spec.parse(bad)
    assert {e.path for e in caught.value.errors} == {
        "spec.stages", "spec.steps", "spec.microBatchs"
    }  # fmt: skip


def test_load_names_the_file_and_yaml_line(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("apiVersion: pipejob.dev/v1alpha1\nkind: PipelineJob\nspec: [\n")
    with pytest.raises(spec.InvalidSpec) as caught:
        spec.load(f)
    assert str(f) in str(caught.value) and "line 4" in str(caught.value)


def test_load_refuses_missing_file_and_many_documents(tmp_path):
    with pytest.raises(spec.InvalidSpec, match="No such file"):
        spec.load(tmp_path / "absent.yaml")
    many = tmp_path / "two.yaml"
    many.write_text("kind: PipelineJob\n---\nkind: HybridJob\n")
    with pytest.raises(spec.InvalidSpec, match="exactly one job, found 2"):
        spec.load(many)
