"""The CRDs are generated from the spec tables: the committed files are current, every field
is documented, the schema defaults and CEL rules agree with the Python model."""

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pipejob.cli import main as cli
from pipejob.core import spec
from pipejob.core.errors import SpecError
from pipejob.core.kinds import KINDS
from pipejob.core.schema import Field, apply
from pipejob.core.workload import IMPORT_PATTERN
from pipejob.operator import crd

pytestmark = pytest.mark.timeout(60)

CRD_DIR = Path(__file__).resolve().parents[1] / "crds"


def version(kind):
    (v,) = crd.crd(KINDS[kind])["spec"]["versions"]
    return v


def root(kind):
    return version(kind)["schema"]["openAPIV3Schema"]


def walk(schema, path):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}")
    if "items" in schema:
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}.*")


def test_committed_crds_are_the_generated_ones():
    """If this fails, run `pipejob crds -o crds` and commit the result."""
    generated = crd.generated()
    assert sorted(p.name for p in CRD_DIR.glob("*.yaml")) == sorted(generated)
    for name, text in generated.items():
        assert (CRD_DIR / name).read_text() == text, f"crds/{name} is stale"


@pytest.mark.parametrize("kind", KINDS)
def test_every_field_is_typed_and_documented(kind):
    # Inside the embedded Kubernetes schemas (core/k8s.py) `kubectl explain` says too little:
    # their descriptions are left out to keep the CRD small; the fields are Kubernetes' own.
    embedded = (
        "template.resources.",
        "template.affinity.",
        "template.env[].",
        "template.volumes[].",
        "template.volumeMounts[].",
        "template.tolerations[].",
    )
    for path, node in walk(root(kind), kind):
        if node.get("x-kubernetes-int-or-string"):  # the one structural schema without a type
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        elif not node.get("x-kubernetes-preserve-unknown-fields"):
            assert node.get("type"), f"{path} has no type (structural schemas need one)"
        if not path.endswith(".metadata") and not any(e in path for e in embedded):
            assert node.get("description"), f"{path} has no description for kubectl explain"


@pytest.mark.parametrize("kind", KINDS)
def test_names_version_subresource_and_columns(kind):
    doc = crd.crd(KINDS[kind])
    names = doc["spec"]["names"]
    assert doc["apiVersion"] == "apiextensions.k8s.io/v1"
    assert doc["metadata"]["name"] == f"{names['plural']}.pipejob.dev"
    assert doc["spec"]["group"] == "pipejob.dev" and doc["spec"]["scope"] == "Namespaced"
    assert names["kind"] == kind
    assert names["shortNames"] == [{"PipelineJob": "pj", "HybridJob": "hj"}[kind]]
    assert names["categories"] == ["pipejob"]
    v = version(kind)
    assert v["name"] == "v1alpha1" and v["served"] and v["storage"]
    assert v["subresources"] == {"status": {}}
    columns = [c["name"] for c in v["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Phase", "Progress", "Restarts", "Age"]
    status = root(kind)["properties"]["status"]["properties"]
    for field in (
        "phase",
        "conditions",
        "roles",
        "startTime",
        "completionTime",
        "restarts",
        "observedGeneration",
        "progress",
        "training",
    ):
        assert field in status, field
    assert status["training"]["x-kubernetes-preserve-unknown-fields"] is True


def test_validations_the_schema_can_express():
    props = root("PipelineJob")["properties"]["spec"]["properties"]
    assert props["stages"]["minimum"] == 2 and props["stages"]["default"] == 2
    micro = props["microBatches"]  # a positive integer or "auto"
    assert micro["x-kubernetes-int-or-string"] is True and "type" not in micro
    assert (micro["minimum"], micro["pattern"], micro["default"]) == (1, "^auto$", 4)
    # A string or an object: the CRD keeps it as written, parse checks it (test_spec.py).
    model = props["model"]
    assert model["x-kubernetes-preserve-unknown-fields"] is True and "type" not in model
    assert model["default"] == "resnet50" and "enum" not in model and "properties" not in model
    assert props["splitPoints"]["maxItems"] == 63
    data = props["data"]["properties"]
    assert data["tokens"]["properties"]["dtype"]["enum"] == ["uint16", "uint32"]
    assert data["import"]["pattern"] == IMPORT_PATTERN
    assert (data["workers"]["default"], data["workers"]["maximum"]) == (2, 32)
    assert props["data"]["default"] == {}  # filled in: workers
    for section in ("eval", "output", "loss"):
        assert "default" not in props[section], section  # absent unless written
    assert props["output"]["properties"]["format"]["default"] == "safetensors"
    assert props["optimizer"]["properties"]["lr"]["exclusiveMinimum"] is True
    assert props["template"]["properties"]["imagePullPolicy"]["enum"] == [
        "Always",
        "IfNotPresent",
        "Never",
    ]
    assert "default" not in root("HybridJob")["properties"]["spec"]["properties"]["backend"]


def k8s_default(schema, value):
    """Structural defaulting as the API server does it."""
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = k8s_default(sub, value[key])
    if schema.get("type") == "array" and isinstance(value, list):
        value = [k8s_default(schema["items"], v) for v in value]
    return value


@pytest.mark.parametrize(
    ("kind", "given"),
    [
        ("PipelineJob", None),
        ("PipelineJob", {"stages": 4, "optimizer": {"name": "adam"}}),
        ("PipelineJob", {"microBatches": "auto"}),
        (
            "PipelineJob",
            {
                "model": {"transformer": {"layers": 2}},
                "data": {"tokens": {"train": "t.bin"}},
                "eval": {},
                "output": {"path": "out"},
            },
        ),
        ("PipelineJob", {"model": {"import": "m:f", "args": {"n": 1}}, "loss": {}}),
        ("HybridJob", {}),
        ("HybridJob", {"dense": {"import": "m:f"}, "data": {"file": {"train": "a.npz"}}}),
        ("HybridJob", {"embedding": {"dim": 4}, "gpusPerTrainer": 1}),
    ],
)
def test_schema_defaults_equal_the_models(kind, given):
    schema = root(kind)
    obj = {"apiVersion": spec.API_VERSION, "kind": kind, "metadata": {"name": "x"}}
    if given is not None:
        obj["spec"] = copy.deepcopy(given)
    by_server = k8s_default(schema, copy.deepcopy(obj))["spec"]
    # What parse does after the table's defaults (the model's shortcut, the DDP backend
    # chosen from the GPUs), the operator does to what the API server stored.
    by_server = KINDS[kind].complete(by_server)
    by_model = spec.parse(obj).spec
    if isinstance((given or {}).get("model"), dict):
        # Kept as written (a string or an object): the defaults inside are parse's alone.
        assert by_server.pop("model") == given["model"]
        assert set(by_model.pop("model")) == set(given["model"])
    assert by_server == by_model


# CEL's reserved words the API server escapes in property names (`import` is `__import__`).
CEL_KEYWORDS = {
    "true",
    "false",
    "null",
    "in",
    "as",
    "break",
    "const",
    "continue",
    "else",
    "for",
    "function",
    "if",
    "import",
    "let",
    "loop",
    "package",
    "namespace",
    "return",
    "var",
    "void",
    "while",
}


def escaped(value):
    """`value` with its property names as the API server shows them to CEL."""
    if isinstance(value, dict):
        return {(f"__{k}__" if k in CEL_KEYWORDS else k): escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [escaped(v) for v in value]
    return value


def cel(rule: str, value, result=bool):
    """Evaluate a CEL rule as the API server would (cel-python, a dev dependency)."""
    celpy = pytest.importorskip("celpy")
    env = celpy.Environment()
    program = env.program(env.compile(rule))
    return result(program.evaluate({"self": celpy.json_to_cel(escaped(value))}))


CASES = {
    "PipelineJob": [
        {},
        {"batchSize": 30, "microBatches": 4},
        {"batchSize": 64, "microBatches": 8},
        {"batchSize": 30, "microBatches": "auto"},
        {"microBatches": "auto"},
        {"batchSize": 32, "microBatches": 3},
        {"stages": 3, "splitPoints": ["layer2", "layer3"]},
        {"stages": 3, "splitPoints": ["layer2"]},
        {"stages": 3, "splitPoints": ["layer2", "layer2"]},
        # the engines and their schedules (issue 31)
        {"schedule": "1f1b"},
        {"engine": "pipelining"},
        {"engine": "pipelining", "stages": 4, "microBatches": 2, "batchSize": 8},
        {
            "engine": "pipelining",
            "schedule": "gpipe",
            "stages": 4,
            "microBatches": 2,
            "batchSize": 8,
        },
        {"engine": "pipelining", "schedule": "interleaved-1f1b"},
        {
            "engine": "pipelining",
            "schedule": "zero-bubble",
            "stagesPerProcess": 2,
            "microBatches": 3,
            "batchSize": 9,
        },
        {
            "engine": "pipelining",
            "schedule": "interleaved-1f1b",
            "stagesPerProcess": 2,
            "microBatches": 4,
            "splitPoints": ["layer2"],
        },
        {"engine": "pipelining", "stagesPerProcess": 2},
        {"stagesPerProcess": 3},
        # elastic acts only on a range (issue 43)
        {"replicas": 2, "elastic": {"pendingSeconds": 5}},
        {
            "replicas": {"min": 1, "max": 2},
            "checkpoint": {"path": "/c"},
            "elastic": {"pendingSeconds": 5},
        },
    ],
    "HybridJob": [
        {},
        {"backend": "nccl"},
        {"backend": "nccl", "gpusPerTrainer": 1},
        {"backend": "gloo"},
        {"trainers": 4, "batchSize": 50, "datasetSize": 199},
        {"trainers": 4, "batchSize": 50, "datasetSize": 200},
        {"trainers": 4, "batchSize": 50, "datasetSize": 199, "data": {"file": {"train": "a.npz"}}},
        {"trainers": 4, "batchSize": 50, "datasetSize": 199, "data": {"import": "m:f"}},
        {"trainers": 4, "batchSize": 50, "datasetSize": 199, "data": {}},
        {
            "trainers": {"min": 2, "max": 4},
            "batchSize": 50,
            "datasetSize": 199,
            "checkpoint": {"path": "/c"},
        },
        {"elastic": {"pendingSeconds": 5}},
        {
            "trainers": {"min": 2, "max": 2},
            "checkpoint": {"path": "/c"},
            "elastic": {"pendingSeconds": 5},
        },
        # servers in the trainers' processes: one per trainer, a number
        {"trainers": 2, "parameterServers": 2, "serversInTrainers": True},
        {"trainers": 2, "parameterServers": 1, "serversInTrainers": True},
        {"trainers": 2, "parameterServers": 1, "serversInTrainers": False},
        {
            "trainers": {"min": 2, "max": 2},
            "parameterServers": 2,
            "serversInTrainers": True,
            "checkpoint": {"path": "/c"},
        },
    ],
}


@pytest.mark.parametrize("kind", KINDS)
def test_cel_rules_agree_with_the_python_checks(kind):
    table = KINDS[kind].spec
    rules = root(kind)["properties"]["spec"]["x-kubernetes-validations"]
    assert [r["rule"] for r in rules] == [r.cel for r in table.rules]
    assert [r["fieldPath"] for r in rules] == [f".{r.path}" for r in table.rules]
    outcomes = set()
    for case in CASES[kind]:
        errors: list[SpecError] = []
        defaulted = apply(table, case, "spec", errors)
        for rule in table.rules:
            expected = rule.check(defaulted)
            assert cel(rule.cel, defaulted) == expected, (rule.cel, case)
            outcomes.add(expected)
            if not expected and rule.message_expression is not None:
                said = cel(rule.message_expression, defaulted, str)
                assert said == rule.reason(defaulted), (said, case)
    assert outcomes == {True, False}  # the cases exercise both sides of the rules


def tables_with_rules(schema: Field, path: str = "spec"):
    """(path, table) of every object below the spec with rules of its own."""
    for key, sub in (schema.fields or {}).items():
        if sub.rules:
            yield f"{path}.{key}", sub
        yield from tables_with_rules(sub, f"{path}.{key}")


# Objects inside the spec with rules: their cases, each broken or kept by some rule.
NESTED_CASES = [
    {},
    {"import": "m:f"},
    {"import": "m:f", "args": {"a": 1}},
    {"args": {"a": 1}},
    {"torchvision": "resnet18"},
    {"torchvision": "resnet18", "import": "m:f"},
    {"transformer": {}},
    {"imageFolder": {"train": "t"}},
    {"tokens": {"train": "t"}},
    {"imageFolder": {"train": "t"}, "tokens": {"train": "t"}},
    {"file": {"train": "t"}},
    {"file": {"train": "t"}, "import": "m:f"},
    {"width": 128, "heads": 4},
    {"width": 128, "heads": 3},
    {"name": "adam", "momentum": 0.5},
    {"name": "adam", "eps": 0.0},
    {"name": "adam", "eps": 1e-8},
    {"name": "adagrad", "eps": 0.0},
    {"stage": "m:f"},
    {"layers": ["a"], "stage": "m:f"},
    {"resources": {"limits": {"nvidia.com/gpu": 1}}},
    {"crossEntropy": {}},
    {"import": "m:f", "crossEntropy": {}},
    {"name": "sgd", "beta1": 0.8},
    {"name": "adamw", "beta1": 0.8},
    {"name": "g"},
    {"name": "g", "preset": "noDecay"},
    {"name": "g", "preset": "noDecay", "params": ["x"]},
    {"earlyStopping": {"patience": 1}},
    {"best": {}, "earlyStopping": {"patience": 1}},
]


@pytest.mark.parametrize("kind", KINDS)
def test_nested_rules_agree_with_their_cel(kind):
    """Rules of objects inside the spec, the model's too: the CRD cannot hold those (the
    model is a string or an object), but their CEL is written and must say the same."""
    checked = set()
    for path, table in tables_with_rules(KINDS[kind].spec):
        for case in NESTED_CASES:
            errors: list[SpecError] = []
            as_object = replace(
                table, type="object", enum=None, rules=(), minimum=None, maximum=None
            )
            defaulted = apply(as_object, case, path, errors)
            if errors:
                continue  # not this object's case
            for rule in table.rules:
                expected = rule.check(defaulted)
                assert cel(rule.cel, defaulted) == expected, (path, rule.cel, case)
                checked.add((path, rule.cel, expected))
    for path, table in tables_with_rules(KINDS[kind].spec):
        if not path.startswith(("spec.model", "spec.data", "spec.loss", "spec.dense")):
            continue  # the others' rules are in the CRD, checked by the API server's tests
        for rule in table.rules:  # every workload rule was seen kept and broken
            assert {(path, rule.cel, True), (path, rule.cel, False)} <= checked, (path, rule)


@pytest.mark.parametrize("name", ["ok", "a-b-1", "Bad", "1abc", "a_b", "x" * 40, "x" * 41, "a-"])
def test_name_rules_agree_with_the_model(name):
    rules = root("PipelineJob")["x-kubernetes-validations"]
    by_cel = all(cel(r["rule"], {"metadata": {"name": name}}) for r in rules)
    obj = {"apiVersion": spec.API_VERSION, "kind": "PipelineJob", "metadata": {"name": name}}
    try:
        spec.parse(obj)
        by_model = True
    except spec.InvalidSpec:
        by_model = False
    assert by_cel == by_model


def test_crds_command_prints_or_writes_them(tmp_path, capsys):
    assert cli.main(["crds"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["spec"]["names"]["kind"] for d in docs] == list(KINDS)
    assert cli.main(["crds", "--output-dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(crd.generated())
