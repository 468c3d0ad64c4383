"""The CRDs embed the real Kubernetes schemas of the pass-through template fields and CEL for
the cross-field rules: the API server refuses what `pipejob validate` refuses.

Checked without a cluster: scripts/validate-manifests.py (jsonschema with the CRD's
structural schema, list-map keys, then every CEL rule with cel-python) in the tools venv,
and the generated schema file against kubernetes-validate's OpenAPI of the pinned version."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from static_tools import tools_python
from test_refusals import CASES, pipeline, tpl

from pipejob.core import k8s, spec
from pipejob.core.kinds import KINDS
from pipejob.core.schema import Field
from pipejob.operator import crd

ROOT = Path(__file__).resolve().parents[1]

# The refusals the API server makes from the CRD alone (the rest need the operator's
# configuration, the model's structure, the YAML text or the env's size).
BY_THE_CRD = [
    "env-int-value",
    "env-no-name",
    "env-bad-name",
    "env-duplicate",
    "env-valuefrom-typo",
    "env-not-a-list",
    "memory-lots",
    "resources-limit-typo",
    "cpu-float",
    "requests-list",
    "volume-capitals",
    "volume-twice",
    "volume-type-typo",
    "pvc-without-claim",
    "emptydir-size-big",
    "configmap-item-no-path",
    "mount-no-path",
    "mount-readonly-string",
    "mount-path-twice",
    "affinity-hides-security-context",
    "affinity-typo",
    "affinity-terms-not-list",
    "toleration-operator",
    "toleration-seconds-string",
    "tolerations-mapping",
    "rendezvous-timeout-overflow",
    "deadline-overflow",
    "preflight-timeout-overflow",
    "profile-after-last-step",
    "momentum-with-adam",
    "two-gpus-per-stage",
    "four-gpus-per-trainer",
    "gpu-in-template-limits",
    "gpu-in-template-requests",
    # issue 12: what the CRD can say of data, loss, dense, output and evaluation (the model is
    # a string or an object, which only pipejob checks)
    "data-import-no-function",
    "data-two-sources",
    "hybrid-data-two-sources",
    "data-args-without-import",
    "tokens-dtype",
    "image-folder-without-train",
    "data-workers-many",
    "loss-import-malformed",
    "loss-args-without-import",
    "split-points-count",
    "split-points-twice",
    "dense-import-malformed",
    "dense-args-without-import",
    "hybrid-data-import-malformed",
    "output-without-path",
    "output-format",
    "eval-negative",
]

GOOD_TEMPLATE = tpl(
    env=[
        {"name": "A", "value": "1"},
        {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
    ],
    resources={"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": 2}},
    volumes=[
        {"name": "data", "persistentVolumeClaim": {"claimName": "c"}},
        {"name": "cfg", "configMap": {"name": "c", "items": [{"key": "k", "path": "p"}]}},
    ],
    volumeMounts=[{"name": "data", "mountPath": "/data"}, {"name": "cfg", "mountPath": "/cfg"}],
    affinity={
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "k", "operator": "In", "values": ["v"]}]}
                ]
            }
        }
    },
    tolerations=[{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
)


def validate_manifests(tmp_path: Path, docs: dict[str, dict]) -> dict[str, list[str]]:
    """{name: errors} of each document, as the API server with the CRDs would see it."""
    files = []
    for name, doc in docs.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc, width=10**6))
        files.append(str(path))
    script = ROOT / "scripts" / "validate-manifests.py"
    proc = subprocess.run(
        [tools_python(), str(script), "--crds", str(ROOT / "crds"), *files],
        capture_output=True,
        text=True,
        timeout=120,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(docs), proc.stderr
    return {Path(r["file"]).stem: r["errors"] for r in results}


def test_the_crds_refuse_the_pass_through_mistakes_and_take_a_full_template(tmp_path):
    docs = {name: body for name, body, _ in CASES if name in BY_THE_CRD}
    assert len(docs) == len(BY_THE_CRD)
    good = pipeline(**GOOD_TEMPLATE)
    spec.parse(good)  # pipejob takes it too
    errors = validate_manifests(tmp_path, {**docs, "good": good})
    assert errors.pop("good") == []
    accepted = [name for name, found in errors.items() if not found]
    assert accepted == [], "the CRD lets these through"


def test_the_embedded_schemas_are_generated_from_the_pinned_kubernetes():
    """If this fails, run scripts/k8s-schemas.py with the tools venv and commit the file."""
    proc = subprocess.run(
        [tools_python(), str(ROOT / "scripts" / "k8s-schemas.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def kubernetes_fields(schema: Field, path: str = "spec"):
    """(path, Kubernetes type) of every table field checked by an embedded schema."""
    if schema.k8s is not None:
        yield path, schema.k8s
    for key, sub in (schema.fields or {}).items():
        yield from kubernetes_fields(sub, f"{path}.{key}")
    if schema.items is not None:
        yield from kubernetes_fields(schema.items, f"{path}[]")


@pytest.mark.parametrize("kind", KINDS)
def test_the_crd_embeds_exactly_the_generated_schema(kind):
    (version,) = crd.crd(KINDS[kind])["spec"]["versions"]
    fields = list(kubernetes_fields(KINDS[kind].spec))
    names = {"EnvVar", "ResourceRequirements", "Volume", "VolumeMount", "Affinity", "Toleration"}
    assert {name for _, name in fields} == names
    for path, name in fields:
        node = version["schema"]["openAPIV3Schema"]
        for part in path.replace("[]", ".[]").split("."):
            node = node["items"] if part == "[]" else node["properties"][part]
        assert {k: v for k, v in node.items() if k != "description"} == k8s.schema(name), path
        assert "x-kubernetes-preserve-unknown-fields" not in node, path


@pytest.mark.parametrize("kind", KINDS)
def test_the_crd_stays_structural_and_small(kind):
    text = json.dumps(crd.crd(KINDS[kind]))
    assert "$ref" not in text and '"oneOf"' not in text  # structural: everything inlined
    # kubectl's client-side apply keeps the whole object in a 256 KiB annotation.
    assert len(text) < 200 * 1024
