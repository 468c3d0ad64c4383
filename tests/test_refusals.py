"""Wrong and hostile manifests, as a hurried user or an attacker writes them: each is refused
by `pipejob validate`, `pipejob run` (before any process starts) and `pipejob render`, with
the field path (or the YAML line) named and no traceback.

Groups (issue 11): 1 checks only the operator made before; 2 pass-through Kubernetes fields
checked against their real schemas; 3 node-level volumes; 4 specs that started and crashed;
5 YAML read as kubectl reads it; 6 (failures no validation can see) is in test_failures.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipejob.cli import main as cli
from pipejob.core import spec

PIPEJOB = Path(sys.executable).parent / "pipejob"


def pipeline(**fields: Any) -> dict:
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": "pj"},
        "spec": {"model": "resnet18", "stages": 2, "batchSize": 8, "imageSize": 32, **fields},
    }


def hybrid(**fields: Any) -> dict:
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": "hj"},
        "spec": {"trainers": 2, **fields},
    }


def tpl(**template: Any) -> dict:
    return {"template": template}


def env(*entries: dict) -> dict:
    return tpl(env=list(entries))


VOLUME = {"name": "data", "emptyDir": {}}
MOUNT = {"name": "data", "mountPath": "/data"}
GOOD_YAML = yaml.safe_dump(pipeline())


def with_line(line: str) -> str:
    """The small pipeline's YAML with one more line under spec."""
    return GOOD_YAML.replace("spec:\n", f"spec:\n  {line}\n", 1)


def laughs() -> str:
    rows = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for prev, name in zip("abcdef", "bcdefg", strict=True):
        rows.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]")
    return "\n".join(rows) + "\n" + GOOD_YAML


# (id, manifest dict or YAML text or bytes, what the error must name)
CASES: list[tuple[str, Any, str]] = [
    # 1. what only `render` and the operator refused before
    ("env-rank", pipeline(**env({"name": "RANK", "value": "3"})), "spec.template.env[0].name"),
    (
        "env-master-addr",
        pipeline(**env({"name": "MASTER_ADDR", "value": "x"})),
        "spec.template.env[0].name",
    ),
    (
        "env-spec",
        pipeline(**env({"name": "A", "value": "1"}, {"name": "PIPEJOB_SPEC", "value": "{}"})),
        "spec.template.env[1].name",
    ),
    (
        "env-world-size-hybrid",
        hybrid(**env({"name": "WORLD_SIZE", "value": "9"})),
        "spec.template.env[0].name",
    ),
    (
        "env-ddp-port-hybrid",
        hybrid(**env({"name": "PIPEJOB_DDP_PORT", "value": "1"})),
        "spec.template.env[0].name",
    ),
    (
        "mount-without-volume",
        pipeline(**tpl(volumeMounts=[MOUNT])),
        "spec.template.volumeMounts[0].name",
    ),
    (
        "checkpoint-volume-missing",
        pipeline(checkpoint={"path": "/ckpt", "volume": "ckpt"}),
        "spec.checkpoint.volume",
    ),
    (
        "checkpoint-relative-path",
        pipeline(checkpoint={"path": "ckpt", "volume": "data"}, **tpl(volumes=[VOLUME])),
        "spec.checkpoint.path",
    ),
    (
        "checkpoint-mounted-twice",
        pipeline(
            checkpoint={"path": "/data", "volume": "data"},
            **tpl(volumes=[VOLUME], volumeMounts=[MOUNT]),
        ),
        "spec.checkpoint.volume",
    ),
    # 2. pass-through fields against the Kubernetes schemas
    ("env-int-value", pipeline(**env({"name": "A", "value": 3})), "spec.template.env[0].value"),
    ("env-no-name", pipeline(**env({"value": "x"})), "spec.template.env[0].name"),
    (
        "env-bad-name",
        pipeline(**env({"name": "MY VAR", "value": "x"})),
        "spec.template.env[0].name",
    ),
    (
        "env-duplicate",
        pipeline(**env({"name": "A", "value": "1"}, {"name": "A", "value": "2"})),
        "spec.template.env[1]",
    ),
    (
        "env-valuefrom-typo",
        pipeline(**env({"name": "A", "valueFrom": {"secretKey": {}}})),
        "spec.template.env[0].valueFrom.secretKey",
    ),
    ("env-not-a-list", pipeline(**tpl(env={"A": "1"})), "spec.template.env"),
    (
        "memory-lots",
        pipeline(**tpl(resources={"limits": {"memory": "lots"}})),
        "spec.template.resources.limits.memory",
    ),
    (
        "resources-limit-typo",
        pipeline(**tpl(resources={"limit": {"cpu": "1"}})),
        "spec.template.resources.limit",
    ),
    (
        "cpu-float",
        pipeline(**tpl(resources={"requests": {"cpu": 0.5}})),
        "spec.template.resources.requests.cpu",
    ),
    (
        "requests-list",
        pipeline(**tpl(resources={"requests": ["cpu"]})),
        "spec.template.resources.requests",
    ),
    (
        "volume-capitals",
        pipeline(**tpl(volumes=[{"name": "Data", "emptyDir": {}}])),
        "spec.template.volumes[0].name",
    ),
    (
        "volume-twice",
        pipeline(**tpl(volumes=[VOLUME, {"name": "data", "secret": {}}])),
        "spec.template.volumes[1]",
    ),
    (
        "volume-type-typo",
        pipeline(**tpl(volumes=[{"name": "d", "emptydir": {}}])),
        "spec.template.volumes[0].emptydir",
    ),
    (
        "pvc-without-claim",
        pipeline(**tpl(volumes=[{"name": "d", "persistentVolumeClaim": {}}])),
        "spec.template.volumes[0].persistentVolumeClaim.claimName",
    ),
    (
        "emptydir-size-big",
        pipeline(**tpl(volumes=[{"name": "d", "emptyDir": {"sizeLimit": "big"}}])),
        "spec.template.volumes[0].emptyDir.sizeLimit",
    ),
    (
        "configmap-item-no-path",
        pipeline(
            **tpl(volumes=[{"name": "d", "configMap": {"name": "c", "items": [{"key": "k"}]}}])
        ),
        "spec.template.volumes[0].configMap.items[0].path",
    ),
    (
        "mount-no-path",
        pipeline(**tpl(volumes=[VOLUME], volumeMounts=[{"name": "data"}])),
        "spec.template.volumeMounts[0].mountPath",
    ),
    (
        "mount-readonly-string",
        pipeline(**tpl(volumes=[VOLUME], volumeMounts=[{**MOUNT, "readOnly": "yes"}])),
        "spec.template.volumeMounts[0].readOnly",
    ),
    (
        "mount-path-twice",
        pipeline(
            **tpl(
                volumes=[VOLUME, {"name": "b", "emptyDir": {}}],
                volumeMounts=[MOUNT, {"name": "b", "mountPath": "/data"}],
            )
        ),
        "spec.template.volumeMounts[1]",
    ),
    (
        "affinity-hides-security-context",
        pipeline(**tpl(affinity={"securityContext": {"privileged": True}})),
        "spec.template.affinity.securityContext",
    ),
    (
        "affinity-typo",
        pipeline(**tpl(affinity={"nodeAfinity": {}})),
        "spec.template.affinity.nodeAfinity",
    ),
    (
        "affinity-terms-not-list",
        pipeline(
            **tpl(
                affinity={
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": {"a": 1}
                        }
                    }
                }
            )
        ),
        "nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms",
    ),
    (
        "toleration-operator",
        pipeline(**tpl(tolerations=[{"key": "k", "operator": "Maybe"}])),
        "spec.template.tolerations[0].operator",
    ),
    (
        "toleration-seconds-string",
        pipeline(
            **tpl(tolerations=[{"key": "k", "effect": "NoExecute", "tolerationSeconds": "60"}])
        ),
        "spec.template.tolerations[0].tolerationSeconds",
    ),
    ("tolerations-mapping", pipeline(**tpl(tolerations={"key": "k"})), "spec.template.tolerations"),
    (
        "namespace-underscore",
        {**pipeline(), "metadata": {"name": "pj", "namespace": "my_ns"}},
        "metadata.namespace",
    ),
    (
        "namespace-int",
        {**hybrid(), "metadata": {"name": "hj", "namespace": 7}},
        "metadata.namespace",
    ),
    # 3. node-level volumes, refused unless the operator allows them
    (
        "hostpath-root",
        pipeline(
            **tpl(
                volumes=[{"name": "root", "hostPath": {"path": "/"}}],
                volumeMounts=[{"name": "root", "mountPath": "/host"}],
            )
        ),
        "spec.template.volumes[0].hostPath",
    ),
    (
        "gitrepo",
        pipeline(**tpl(volumes=[{"name": "src", "gitRepo": {"repository": "x"}}])),
        "spec.template.volumes[0].gitRepo",
    ),
    (
        "flexvolume",
        hybrid(**tpl(volumes=[{"name": "f", "flexVolume": {"driver": "x/y"}}])),
        "spec.template.volumes[0].flexVolume",
    ),
    (
        "hostpath-second",
        hybrid(
            **tpl(volumes=[VOLUME, {"name": "h", "hostPath": {"path": "/var/run/docker.sock"}}])
        ),
        "spec.template.volumes[1].hostPath",
    ),
    (
        "hostpath-checkpoint",
        pipeline(
            checkpoint={"path": "/ckpt", "volume": "h"},
            **tpl(volumes=[{"name": "h", "hostPath": {"path": "/tmp"}}]),
        ),
        "spec.template.volumes[0].hostPath",
    ),
    # 4. valid-looking specs whose world crashed after starting
    (
        "batchnorm-micro-batch-of-one",
        pipeline(model="resnet50", batchSize=4, microBatches=4),
        "spec.microBatches",
    ),
    (
        "batchnorm-batch-of-one-auto",
        pipeline(model="mobilenet_v2", batchSize=1, microBatches="auto"),
        "spec.batchSize",
    ),
    ("alexnet-small-image", pipeline(model="alexnet", imageSize=32), "spec.imageSize"),
    ("more-stages-than-layers", pipeline(model="resnet18", stages=16), "spec.stages"),
    ("seed-beyond-64-bits", pipeline(seed=2**64), "spec.seed"),
    (
        "rendezvous-timeout-overflow",
        pipeline(rendezvousTimeoutSeconds=10**12),
        "spec.rendezvousTimeoutSeconds",
    ),
    ("deadline-overflow", hybrid(activeDeadlineSeconds=2**40), "spec.activeDeadlineSeconds"),
    (
        "preflight-timeout-overflow",
        hybrid(preflight={"timeoutSeconds": 10**9}),
        "spec.preflight.timeoutSeconds",
    ),
    ("num-classes-huge", pipeline(numClasses=10**30), "spec.numClasses"),
    (
        "profile-after-last-step",
        pipeline(steps=5, profile={"steps": [6], "path": "/p"}),
        "spec.profile.steps",
    ),
    (
        "momentum-with-adam",
        hybrid(optimizer={"name": "adam", "momentum": 0.9}),
        "spec.optimizer.momentum",
    ),
    ("two-gpus-per-stage", pipeline(gpusPerStage=2), "spec.gpusPerStage"),
    ("four-gpus-per-trainer", hybrid(gpusPerTrainer=4), "spec.gpusPerTrainer"),
    (
        "gpu-in-template-limits",
        pipeline(gpusPerStage=1, **tpl(resources={"limits": {"nvidia.com/gpu": 4}})),
        "spec.template.resources",
    ),
    (
        "gpu-in-template-requests",
        hybrid(**tpl(resources={"requests": {"nvidia.com/gpu": 1}})),
        "spec.template.resources",
    ),
    ("nan-lr", with_line("optimizer: {lr: .nan}"), "spec.optimizer.lr"),
    ("inf-lr", with_line("optimizer: {lr: .inf}"), "spec.optimizer.lr"),
    ("nan-megabytes", with_line("preflight: {megabytes: .NaN}"), "spec.preflight.megabytes"),
    (
        "minus-inf-weight-decay",
        with_line("optimizer: {weightDecay: -.inf}"),
        "spec.optimizer.weightDecay",
    ),
    ("overflowing-float-steps", with_line("steps: 1e400"), "spec.steps"),
    # 5. YAML as kubectl reads it, hostile input
    ("duplicate-key", with_line("steps: 5\n  steps: 6"), "line"),
    ("sexagesimal-is-a-string", with_line("steps: 10:00"), "spec.steps"),
    ("yes-is-a-string", with_line("suspend: yes"), "spec.suspend"),
    ("not-utf8", GOOD_YAML.encode().replace(b"resnet18", b"resn\xe9t18"), "not UTF-8"),
    ("deep-nesting", "a: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper"),
    ("recursive-alias", "x: &x [*x]\n" + GOOD_YAML, "refers to itself"),
    ("billion-laughs", laughs(), "expands to more than"),
    ("binary-env-value", with_line("template: {env: [{name: A, value: !!binary aGk=}]}"), "line"),
    (
        "timestamp-tag",
        with_line("template: {env: [{name: A, value: !!timestamp 2024-01-01}]}"),
        "line",
    ),
    ("python-object-tag", with_line("seed: !!python/object/apply:os.system [id]"), "line"),
    ("non-string-key", with_line("1: 2"), "line"),
    ("complex-key", with_line("? [a, b]\n  : c"), "line"),
    ("image-200kb", pipeline(**tpl(image="x" * 200_000)), "spec"),
    (
        "env-too-big",
        pipeline(**env(*({"name": f"V{i}", "value": "x" * 100} for i in range(800)))),
        "spec",
    ),
    ("two-documents", GOOD_YAML + "---\n" + GOOD_YAML, "(document)"),
    ("empty-file", "", "(document)"),
    ("control-character", GOOD_YAML.replace("resnet18", "resnet\x0718"), "not valid YAML"),
    ("huge-file", GOOD_YAML + "#" * (1024 * 1024) + "\n", "larger than"),
    # 7. the user's model, data, loss and output (issue 12)
    ("model-import-no-function", pipeline(model={"import": "mypkg.models"}), "spec.model.import"),
    ("model-import-double-dot", pipeline(model={"import": "a..b:c"}), "spec.model.import"),
    ("model-import-two-colons", pipeline(model={"import": "a:b:c"}), "spec.model.import"),
    (
        "model-two-sources",
        pipeline(model={"torchvision": "resnet18", "import": "m:f"}),
        "spec.model: give exactly one of torchvision, transformer or import",
    ),
    ("model-no-source", pipeline(model={"args": {}}), "spec.model:"),
    (
        "model-args-without-import",
        pipeline(model={"torchvision": "resnet18", "args": {"n": 1}}),
        "spec.model.args",
    ),
    ("model-unknown-key", pipeline(model={"imports": "m:f"}), "spec.model.imports"),
    ("model-a-number", pipeline(model=50), "spec.model: must be a string or a mapping"),
    (
        "model-unknown-torchvision",
        pipeline(model={"torchvision": "resnet5"}),
        "spec.model.torchvision",
    ),
    (
        "transformer-heads",
        pipeline(model={"transformer": {"width": 100, "heads": 3}}),
        "spec.model.transformer.heads",
    ),
    (
        "transformer-zero-layers",
        pipeline(model={"transformer": {"layers": 0}}),
        "spec.model.transformer.layers",
    ),
    ("data-import-no-function", pipeline(data={"import": "mypkg.data"}), "spec.data.import"),
    (
        "data-two-sources",
        pipeline(data={"imageFolder": {"train": "t"}, "import": "m:f"}),
        "spec.data: give at most one data source",
    ),
    (
        "data-args-without-import",
        pipeline(data={"imageFolder": {"train": "t"}, "args": {}}),
        "spec.data.args",
    ),
    (
        "tokens-without-seq-len",
        pipeline(data={"tokens": {"train": "t.bin"}}),
        "spec.data.tokens.seqLen",
    ),
    (
        "tokens-dtype",
        pipeline(model={"transformer": {}}, data={"tokens": {"train": "t", "dtype": "int8"}}),
        "spec.data.tokens.dtype",
    ),
    (
        "image-folder-without-train",
        pipeline(data={"imageFolder": {"val": "v"}}),
        "spec.data.imageFolder.train",
    ),
    ("data-workers-many", pipeline(data={"workers": 64}), "spec.data.workers"),
    ("loss-import-malformed", pipeline(loss={"import": "losses:"}), "spec.loss.import"),
    ("loss-args-without-import", pipeline(loss={"args": {"w": 1}}), "spec.loss.args"),
    (
        "split-points-count",
        pipeline(stages=3, splitPoints=["layer3"]),
        "spec.splitPoints: must list stages - 1 = 2 module names",
    ),
    (
        "split-points-twice",
        pipeline(stages=3, splitPoints=["layer3", "layer3"]),
        "spec.splitPoints: each module name",
    ),
    ("dense-import-malformed", hybrid(dense={"import": "mymod.Dense"}), "spec.dense.import"),
    ("dense-args-without-import", hybrid(dense={"args": {"h": 1}}), "spec.dense.args"),
    (
        "hybrid-data-two-sources",
        hybrid(data={"file": {"train": "a.npz"}, "import": "m:f"}),
        "spec.data: give at most one data source",
    ),
    ("hybrid-data-import-malformed", hybrid(data={"import": "data"}), "spec.data.import"),
    ("output-without-path", pipeline(output={"format": "torch"}), "spec.output.path"),
    ("output-format", pipeline(output={"path": "o", "format": "onnx"}), "spec.output.format"),
    ("eval-negative", pipeline(eval={"everySteps": -1}), "spec.eval.everySteps"),
    # the engines and their schedules (issue 31): both fields named
    (
        "schedule-on-rpc",
        pipeline(engine="rpc", schedule="1f1b"),
        "spec.schedule: the rpc engine (spec.engine) runs gpipe only",
    ),
    (
        "1f1b-too-few-micro-batches",
        pipeline(engine="pipelining", stages=4, microBatches=2),
        "spec.microBatches: spec.schedule 1f1b needs at least as many micro-batches as stages",
    ),
    (
        "interleaved-rounds",
        pipeline(
            engine="pipelining",
            schedule="zero-bubble",
            stagesPerProcess=2,
            stages=3,
            microBatches=4,
        ),
        "spec.microBatches: spec.schedule zero-bubble runs micro-batches in rounds",
    ),
    (
        "interleaved-one-piece",
        pipeline(engine="pipelining", schedule="interleaved-1f1b"),
        "spec.stagesPerProcess: spec.schedule interleaved-1f1b interleaves several stages",
    ),
    (
        "pieces-without-interleaving",
        pipeline(engine="pipelining", stagesPerProcess=2),
        "spec.stagesPerProcess: only the interleaved schedules",
    ),
    (
        "auto-none-fits",
        pipeline(
            engine="pipelining", stages=8, model="resnet152", microBatches="auto", batchSize=4
        ),
        "spec.microBatches: auto chooses among 1, 2 micro-batches",
    ),
    (
        "too-many-pieces",
        pipeline(
            engine="pipelining",
            schedule="interleaved-1f1b",
            stages=4,
            stagesPerProcess=4,
            microBatches=4,
        ),
        "spec.stages: resnet18 has 14 places to cut; it can fill at most 14 stages, not 4 x"
        " stagesPerProcess 4",
    ),
]


def write(tmp_path: Path, name: str, body: Any) -> Path:
    path = tmp_path / f"{name}.yaml"
    if isinstance(body, bytes):
        path.write_bytes(body)
    elif isinstance(body, str):
        path.write_text(body)
    else:
        path.write_text(yaml.safe_dump(body, width=10**6))
    return path


def test_at_least_sixty_cases_with_distinct_names():
    names = [c[0] for c in CASES]
    assert len(names) == len(set(names)) and len(names) >= 60


@pytest.mark.parametrize(("name", "body", "where"), CASES, ids=[c[0] for c in CASES])
def test_refused_by_validate_run_and_render(name, body, where, tmp_path, capsys, monkeypatch):
    path = write(tmp_path, name, body)
    with pytest.raises(spec.InvalidSpec) as refused:
        spec.load(path)
    named = [str(e) for e in refused.value.errors]
    assert any(where in line for line in named), named

    import pipejob.runner.local as local

    def no_process(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pipejob run started a process for a refused manifest")

    monkeypatch.setattr(local.subprocess, "Popen", no_process)
    for argv in (["validate", str(path)], ["run", str(path)], ["render", str(path)]):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # run exits through _load_or_exit
            code = e.code
        out, err = capsys.readouterr()
        assert code == 2, (argv, out, err)
        assert where in err and "Traceback" not in err + out, (argv, err)
        assert "started" not in out and "valid" not in out


@pytest.mark.parametrize("name", ["hostpath-root", "env-rank", "billion-laughs", "not-utf8"])
def test_the_real_command_refuses_without_a_traceback_or_a_process(name, tmp_path):
    body = next(c[1] for c in CASES if c[0] == name)
    path = write(tmp_path, name, body)
    done = subprocess.run(
        [str(PIPEJOB), "run", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "pipejob: started" not in done.stdout
    assert done.stdout == ""  # the runner never said a word: nothing started


def test_node_volumes_pass_when_allowed(tmp_path, capsys):
    body = next(c[1] for c in CASES if c[0] == "hostpath-root")
    path = write(tmp_path, "allowed", body)
    assert cli.main(["validate", "--allow-node-volumes", str(path)]) == 0
    assert cli.main(["render", "--allow-node-volumes", str(path)]) == 0
    pods = [d for d in yaml.safe_load_all(capsys.readouterr().out.split("\n", 1)[1]) if d]
    assert any(v.get("hostPath") for d in pods if d["kind"] == "Pod" for v in d["spec"]["volumes"])


def test_merge_keys_work_as_in_kubectl(tmp_path):
    text = with_line("optimizer: {<<: {name: adam, lr: 0.01}, lr: 0.02}")
    job = spec.load(write(tmp_path, "merged", text))
    assert job.spec["optimizer"]["name"] == "adam" and job.spec["optimizer"]["lr"] == 0.02


def test_yaml_12_values_are_read_as_kubectl_reads_them(tmp_path):
    text = with_line(
        "template: {env: [{name: T, value: 10:00}, {name: Y, value: yes}, "
        "{name: D, value: 2024-01-01}]}\n  seed: 012"
    )
    job = spec.load(write(tmp_path, "yaml12", text))
    values = [e["value"] for e in job.spec["template"]["env"]]
    assert values == ["10:00", "yes", "2024-01-01"] and job.spec["seed"] == 12


@pytest.mark.parametrize("allow", [False, True])
def test_the_chart_value_reaches_the_operator(allow, tmp_path):
    from static_tools import documents, helm_template

    from pipejob.cli.main import build_parser

    values = {"allowNodeVolumes": True} if allow else None
    (deployment,) = [
        d for d in documents(helm_template(values, tmp_path)) if d["kind"] == "Deployment"
    ]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert build_parser().parse_args(["operator", *args]).allow_node_volumes is allow
