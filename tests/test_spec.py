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
    assert s["model"] == {"torchvision": "resnet50"}  # the shortcut, completed
    assert s["steps"] == 10 and s["imageSize"] == 224
    assert s["optimizer"] == {
        "name": "sgd",
        "lr": 0.05,
        "momentum": 0.0,
        "weightDecay": 0.0,
        "beta1": 0.9,
        "beta2": 0.999,
    }
    assert s["backoffLimit"] == 3 and s["gpusPerStage"] == 0 and s["suspend"] is False
    assert "template" not in s and "activeDeadlineSeconds" not in s


def test_workload_fields_default_and_convert_to_the_typed_spec():
    """The user's model, data, loss, evaluation and output (core/workload.py, data_sources.py)."""
    from pipejob.core.data_sources import Split, Tokens
    from pipejob.core.workload import Eval, Loss, Model, Output, Transformer

    plain = spec.parse(pipeline(model="resnet18"))
    assert plain.spec["data"] == {"workers": 2}  # synthetic, with its loader's workers
    for section in ("loss", "eval", "output", "splitPoints"):
        assert section not in plain.spec, section  # absent unless written
    typed = plain.settings
    assert typed.model == Model(torchvision="resnet18")
    assert (typed.loss, typed.eval, typed.output, typed.split_points) == (Loss(), None, None, ())
    assert typed.data.image_folder is typed.data.tokens is typed.data.import_ is None

    lm = spec.parse(
        pipeline(
            model={"transformer": {"layers": 2}},
            stages=3,
            splitPoints=["blocks.0", "blocks.1"],
            data={"tokens": {"train": "train.bin", "val": "val.bin"}, "workers": 0},
            loss={"import": "losses.text:smoothed", "args": {"eps": 0.1}},
            eval={"everySteps": 50},
            output={"path": "out"},
        )
    ).settings
    assert lm.model == Model(
        transformer=Transformer(vocab_size=256, layers=2, width=128, heads=4, seq_len=128)
    )
    assert lm.split_points == ("blocks.0", "blocks.1")
    assert lm.data.tokens == Tokens(train="train.bin", val="val.bin", dtype="uint16")
    assert lm.data.workers == 0
    assert lm.loss == Loss(import_="losses.text:smoothed", args={"eps": 0.1})
    assert lm.eval == Eval(every_steps=50, batches=0)
    assert lm.output == Output(path="out", format="safetensors")

    mine = spec.parse(
        pipeline(
            model={"import": "mypkg.models:small_cnn", "args": {"classes": 10}},
            data={"imageFolder": {"train": "digits/train", "val": "digits/val"}},
        )
    ).settings
    assert mine.model == Model(import_="mypkg.models:small_cnn", args={"classes": 10})
    assert mine.data.image_folder == Split(train="digits/train", val="digits/val")

    bags = spec.parse(
        hybrid(
            dense={"import": "mypkg.dense:Tower", "args": {"hidden": 32}},
            data={"file": {"train": "train.npz"}},
        )
    ).settings
    assert (bags.dense.import_, bags.dense.args, bags.dense.out_features) == (
        "mypkg.dense:Tower",
        {"hidden": 32},
        8,
    )
    assert bags.data.file == Split(train="train.npz") and bags.data.import_ is None
    assert spec.parse(hybrid()).settings.data.file is None  # synthetic bags


def test_past_the_parser_a_job_is_read_through_typed_settings_made_once():
    """Job.settings and Job.control are made once per Job (and kept by Job.sized); Job.shape,
    what the plan counts from, is the settings with the elastic size one number, not a dict."""
    from pipejob.core.elastic import Size
    from pipejob.core.kinds.pipeline import PipelineSpec

    manifest = pipeline(replicas={"min": 1, "max": 3}, checkpoint={"path": "/ckpt"})
    manifest["spec"]["scheduling"] = {"provider": "volcano", "queue": "q"}
    manifest["spec"]["oom"] = {"maxMemory": "8Gi"}
    job = spec.parse(manifest)
    assert isinstance(job.settings, PipelineSpec) and job.settings is job.settings
    assert job.settings.replicas == Size(min=1, max=3)
    assert job.shape.replicas == Size(min=3, max=3)  # the largest
    smaller = job.sized(2)  # the operator's world of 2: the settings come along, not remade
    assert smaller.shape.replicas == Size(min=2, max=2) and smaller.settings is job.settings
    control = job.control
    assert control is job.control
    assert (control.suspend, control.backoff_limit, control.active_deadline_seconds) == (
        False,
        3,
        None,
    )
    assert control.pending_seconds == 120 and control.oom.cap == 8 * 2**30
    assert control.scheduling is not None and control.scheduling.queue == "q"
    with pytest.raises(ValueError, match="a world of 4 is outside 1 to 3"):
        job.sized(4).shape  # noqa: B018


@pytest.mark.parametrize(
    ("data", "ok"),
    [(None, False), ({"file": {"train": "t.npz"}}, True), ({"import": "m:f"}, True)],
)
def test_dataset_size_binds_synthetic_bags_only(data, ok):
    manifest = hybrid(trainers=4, batchSize=50, datasetSize=100)
    if data is not None:
        manifest["spec"]["data"] = data
    if ok:
        spec.parse(manifest)
    else:
        with pytest.raises(spec.InvalidSpec, match="spec.datasetSize"):
            spec.parse(manifest)


def test_split_points_error_says_the_count_it_needs():
    with pytest.raises(spec.InvalidSpec) as refused:
        spec.parse(pipeline(stages=4, splitPoints=["layer2"]))
    (error,) = refused.value.errors
    assert error.path == "spec.splitPoints"
    assert "stages - 1 = 3 module names" in error.reason and "got 1" in error.reason


@pytest.mark.parametrize(
    "bad",
    ["mypkg.models", "a..b:c", "a:b:c", ":f", "m:", "1pkg:f", "m:f ", "pkg-name:f", ""],
)
def test_malformed_import_paths_are_refused_in_words(bad):
    for manifest, path in (
        (pipeline(model={"import": bad}), "spec.model.import"),
        (pipeline(data={"import": bad}), "spec.data.import"),
        (pipeline(loss={"import": bad}), "spec.loss.import"),
        (hybrid(dense={"import": bad}), "spec.dense.import"),
    ):
        with pytest.raises(spec.InvalidSpec) as refused:
            spec.parse(manifest)
        (error,) = refused.value.errors
        assert error.path == path
        assert "import path 'package.module:function'" in error.reason and repr(bad) in error.reason


@pytest.mark.parametrize("good", ["m:f", "my_pkg.sub.mod:Factory", "pkg.mod:Class.build"])
def test_well_formed_import_paths_pass(good):
    assert spec.parse(pipeline(model={"import": good})).settings.model.import_ == good


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
    (
        _with(pipeline(), "apiVersion", "pipejob.dev/v1"),
        "apiVersion",
        "must be pipejob.dev/v1alpha1",
    ),
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
    (
        pipeline(microBatches="Auto"),
        "spec.microBatches",
        "must be an integer or a string matching auto, got 'Auto'",
    ),
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
    (
        pipeline(template={"imagePullPolicy": "Sometimes"}),
        "spec.template.imagePullPolicy",
        "must be one of",
    ),
    (
        pipeline(template={"nodeSelector": {"gpu": 1}}),
        "spec.template.nodeSelector.gpu",
        "must be a string",
    ),
    (
        pipeline(template={"tolerations": {"key": "x"}}),
        "spec.template.tolerations",
        "must be a list",
    ),
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
]


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
        "spec.stages",
        "spec.steps",
        "spec.microBatchs",
    }


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
