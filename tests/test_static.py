"""Static checks of everything that goes to a cluster: the Helm chart (helm lint, helm
template with default and non-default values), every rendered manifest, example and CRD
against the Kubernetes schemas and the CRDs' own schemas and CEL rules, the Dockerfile
(hadolint), the shell scripts (shellcheck), the security posture of the chart and of the
pods the operator renders for the examples (checkov), and YAML style (yamllint).

The tools come from scripts/install-tools.sh; see static_tools.py for how a missing one is
treated. Each tool runs once over all its inputs, to keep this file fast."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from static_tools import (
    CHART,
    NAMESPACE,
    ROOT,
    documents,
    helm_template,
    run,
    tool,
    tools_python,
)

from pipejob.core import spec
from pipejob.core.kinds import KINDS
from pipejob.operator import kube, policy_settings

pytestmark = pytest.mark.timeout(180)

EXAMPLES = sorted((ROOT / "examples").glob("**/*.yaml"))  # and the folders of examples with code
JOBS_NAMESPACE = "ml-team"

# Built-in kinds are validated for the oldest Kubernetes the chart supports (the CRDs' CEL
# rules use fieldPath, new in 1.28) and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.28.0", "1.37.0")

# A non-default install: a namespace list (Roles, no ClusterRole), two peered replicas, a
# private registry, and scheduling constraints.
CUSTOM_VALUES: dict[str, Any] = {
    "replicas": 2,
    "watchNamespaces": ["ml-team", "research"],
    "peering": {"name": "ml-operators"},
    "image": {
        "repository": "registry.example.com/ml/pipejob-operator",
        "tag": "1.2.3",
        "pullPolicy": "Always",
    },
    "trainerImage": "registry.example.com/ml/pipejob-trainer:1.2.3",
    "logLevel": "debug",
    "serviceAccount": {"name": "pipejob-operator"},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}
    ],
    "metrics": {"enabled": False},
    "networkPolicy": {
        "jobs": {
            "monitorFrom": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                    },
                    "podSelector": {
                        "matchExpressions": [
                            {
                                "key": "app.kubernetes.io/name",
                                "operator": "In",
                                "values": ["prometheus"],
                            }
                        ]
                    },
                }
            ],
            "restrictEgress": True,
            "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}], "ports": [{"port": 443}]}],
        }
    },
}

# Every security check must pass on the operator's Deployment and every rendered pod:
# not privileged, no host namespaces or ports, no privilege escalation, not root, no added
# capabilities and ALL dropped (NET_RAW included), the runtime's seccomp profile.
SECURITY_CHECKS = {
    "CKV_K8S_16",
    "CKV_K8S_17",
    "CKV_K8S_18",
    "CKV_K8S_19",
    "CKV_K8S_20",
    "CKV_K8S_23",
    "CKV_K8S_25",
    "CKV_K8S_26",
    "CKV_K8S_28",
    "CKV_K8S_31",
    "CKV_K8S_37",
}
READ_ONLY_ROOT = "CKV_K8S_22"  # the operator only: the trainer may write (checkpoints, /tmp)

# Checks skipped, and why. Everything else checkov knows must pass on the chart.
CHECKOV_SKIPS = {
    "CKV_K8S_15": "imagePullPolicy Always: IfNotPresent with a pinned tag is the default; "
    "Always would break clusters that preload images (kind, air-gapped)",
    "CKV_K8S_38": "service account token: the operator talks to the API server",
    "CKV_K8S_43": "image digest: users pin one by setting image.tag to TAG@sha256:DIGEST",
}


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The chart rendered with the default and the custom values (CRDs included)."""
    tmp = tmp_path_factory.mktemp("chart")
    out = {}
    # Every gang-scheduling integration on: the extra ClusterRole rules render valid too.
    gangs = {"scheduling": {n: {"enabled": True} for n in ("kueue", "volcano", "coscheduling")}}
    for name, values in (("default", None), ("custom", CUSTOM_VALUES), ("gangs", gangs)):
        path = tmp / f"chart-{name}.yaml"
        path.write_text(helm_template(values, tmp, crds=True))
        out[name] = path
    return out


@pytest.fixture(scope="module")
def pod_renders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`pipejob render` of every example: the Service, NetworkPolicy and Pods the operator
    would create; and of one more with the custom values' NetworkPolicy settings."""
    tmp = tmp_path_factory.mktemp("pods")
    out = {}
    for example in EXAMPLES:
        proc = run(
            [sys.executable, "-m", "pipejob.cli", "render", "-n", JOBS_NAMESPACE, str(example)]
        )
        name = "-".join(example.relative_to(ROOT / "examples").parts)  # folder-file.yaml
        path = tmp / name
        path.write_text(proc.stdout)
        out[name] = path
    custom = policy_env(CUSTOM_VALUES, tmp)
    proc = run(
        [
            sys.executable,
            "-m",
            "pipejob.cli",
            "render",
            "-n",
            JOBS_NAMESPACE,
            str(ROOT / "examples" / "hybrid.yaml"),
        ],
        env=custom,
    )
    out["hybrid-custom-policy.yaml"] = tmp / "hybrid-custom-policy.yaml"
    out["hybrid-custom-policy.yaml"].write_text(proc.stdout)
    return out


def policy_env(values: dict[str, Any] | None, tmp: Path) -> dict[str, str]:
    """PIPEJOB_NETWORK_POLICY as the chart rendered with `values` gives it to the operator."""
    container = _deployment(documents(helm_template(values, tmp)))["spec"]["template"]["spec"][
        "containers"
    ][0]
    return {
        e["name"]: e["value"] for e in container["env"] if e["name"] == policy_settings.POLICY_ENV
    }


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


# --- examples ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_example_is_a_valid_job(path: Path) -> None:
    job = spec.load(path)  # the one validation: what the operator would refuse fails here
    assert job.kind in KINDS


def test_every_kind_has_a_cpu_and_a_gpu_example() -> None:
    gpu_field = {"PipelineJob": "gpusPerStage", "HybridJob": "gpusPerTrainer"}
    seen = set()
    for path in EXAMPLES:
        job = spec.load(path)
        seen.add((job.kind, job.spec[gpu_field[job.kind]] > 0))
    assert seen >= {(kind, gpu) for kind in KINDS for gpu in (False, True)}


def test_gpu_examples_ask_for_gpus_and_nccl(pod_renders: dict[str, Path]) -> None:
    pods = by_kind(documents(pod_renders["hybrid-gpu.yaml"].read_text()), "Pod")
    trainers = [p for p in pods if p["metadata"]["labels"][kube.ROLE_LABEL] == "trainer"]
    assert trainers
    for pod in trainers:
        container = pod["spec"]["containers"][0]
        assert container["resources"]["limits"][kube.GPU] == 1
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["PIPEJOB_DDP_BACKEND"] == "nccl"
        assert {"key": kube.GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["spec"][
            "tolerations"
        ]
    pods = by_kind(documents(pod_renders["resnet50-pipeline-gpu.yaml"].read_text()), "Pod")
    stages = [p for p in pods if p["metadata"]["labels"][kube.ROLE_LABEL] == "stage"]
    assert len(stages) == 4
    assert all(p["spec"]["containers"][0]["resources"]["limits"][kube.GPU] == 1 for p in stages)


# --- the chart --------------------------------------------------------------------------


def test_chart_crds_are_the_crds(tmp_path: Path) -> None:
    """The chart ships byte-identical copies of crds/ (plus kopf's peering CRDs)."""
    ours = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    shipped = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert ours, "crds/ is empty"
    assert set(shipped) == set(ours) | {"kopf-peering.yaml"}
    for name, text in ours.items():
        assert shipped[name] == text, f"charts/pipejob/crds/{name} differs from crds/{name}"


def test_helm_lint(tmp_path: Path) -> None:
    helm = tool("helm")
    run([helm, "lint", "--strict", str(CHART)])
    values = tmp_path / "values.yaml"
    values.write_text(json.dumps(CUSTOM_VALUES))
    run([helm, "lint", "--strict", str(CHART), "--values", str(values)])


def _deployment(docs: list[dict]) -> dict:
    (deployment,) = by_kind(docs, "Deployment")
    return deployment


def test_default_render(renders: dict[str, Path]) -> None:
    docs = documents(renders["default"].read_text())
    kinds = {d["kind"] for d in docs}
    assert {
        "ClusterRole",
        "ClusterRoleBinding",
        "ServiceAccount",
        "Service",
        "Deployment",
        "NetworkPolicy",
        "CustomResourceDefinition",
    } <= kinds
    assert not kinds & {"Role", "RoleBinding", "ClusterKopfPeering", "KopfPeering"}
    deployment = _deployment(docs)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/pipejob/operator:0.1.0"
    assert container["args"] == [
        "--all-namespaces",
        "--standalone",
        "--log-level=info",
        "--health-port=8080",
        "--metrics-port=8081",
    ]
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in container["ports"]
    (service,) = by_kind(docs, "Service")
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [
        ("health", 8080),
        ("metrics", 8081),
    ]
    (policy,) = by_kind(docs, "NetworkPolicy")
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == ["health", "metrics"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[kube.IMAGE_ENV] == "ghcr.io/pipejob/trainer:0.1.0"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["runAsNonRoot"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    crds = {d["metadata"]["name"] for d in by_kind(docs, "CustomResourceDefinition")}
    assert {"pipelinejobs.pipejob.dev", "hybridjobs.pipejob.dev"} <= crds


def test_custom_render(renders: dict[str, Path]) -> None:
    docs = documents(renders["custom"].read_text())
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"}
    for kind in ("Role", "RoleBinding", "KopfPeering"):
        namespaces = sorted(d["metadata"]["namespace"] for d in by_kind(docs, kind))
        assert namespaces == sorted(CUSTOM_VALUES["watchNamespaces"]), kind
    for peering in by_kind(docs, "KopfPeering"):
        assert peering["metadata"]["name"] == "ml-operators"
    deployment = _deployment(docs)
    assert deployment["spec"]["replicas"] == 2
    assert "strategy" not in deployment["spec"]  # peered replicas roll one by one
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "pipejob-operator"
    assert pod["nodeSelector"] == CUSTOM_VALUES["nodeSelector"]
    assert pod["tolerations"] == CUSTOM_VALUES["tolerations"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.example.com/ml/pipejob-operator:1.2.3"
    assert container["imagePullPolicy"] == "Always"
    assert container["args"] == [
        "--namespace=ml-team",
        "--namespace=research",
        "--peering=ml-operators",
        "--log-level=debug",
        "--health-port=8080",
        "--metrics-port=0",
    ]
    assert [p["name"] for p in container["ports"]] == ["health"]  # metrics disabled
    (service,) = by_kind(docs, "Service")
    assert [p["name"] for p in service["spec"]["ports"]] == ["health"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[kube.IMAGE_ENV] == CUSTOM_VALUES["trainerImage"]


@pytest.mark.parametrize(
    "values, message",
    [
        ({"logLevel": "verbose"}, "at '/logLevel': value must be one of"),
        ({"watchNamespaces": ["Team_A"]}, "at '/watchNamespaces/0': 'Team_A' does not match"),
        ({"replicas": 0}, "at '/replicas'"),
        ({"replicaz": 2}, "additional properties 'replicaz' not allowed"),
        (
            {"networkPolicy": {"jobs": {"monitorFrom": [{}]}}},
            "at '/networkPolicy/jobs/monitorFrom/0'",
        ),
    ],
)
def test_bad_values_are_refused_with_the_field(values: dict, message: str, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(json.dumps(values))
    proc = run(
        [tool("helm"), "template", "pipejob", str(CHART), "--values", str(path)], check=False
    )
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_operator_accepts_the_charts_arguments(renders: dict[str, Path]) -> None:
    """The Deployment's args parse with the real `pipejob operator` command line."""
    from pipejob.cli.main import build_parser

    for name in ("default", "custom"):
        container = _deployment(documents(renders[name].read_text()))["spec"]["template"]["spec"][
            "containers"
        ][0]
        args = build_parser().parse_args(["operator", *container["args"]])
        assert args.command == "operator"
        assert args.health_port == 8080
        assert args.metrics_port == (8081 if name == "default" else 0)


@pytest.mark.parametrize("values", ["default", "custom", "off"])
def test_the_operator_reads_the_charts_network_policy_setting(values: str, tmp_path: Path) -> None:
    """The chart's networkPolicy.jobs values reach the operator as settings it accepts, with
    the operator's own pods first among the peers of the monitor port (it polls /progress)."""
    given = {
        "default": None,
        "custom": CUSTOM_VALUES,
        "off": {"networkPolicy": {"jobs": {"enabled": False}}},
    }[values]
    settings = policy_settings.from_env(policy_env(given, tmp_path))
    if values == "off":
        assert settings is None
        return
    pods = _deployment(documents(helm_template(given, tmp_path)))["spec"]["selector"]
    operator = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
        "podSelector": {"matchLabels": pods["matchLabels"]},
    }
    jobs = (given or {}).get("networkPolicy", {}).get("jobs", {})
    assert settings.monitor_from == (operator, *jobs.get("monitorFrom", []))
    assert settings.egress == (tuple(jobs["egress"]) if jobs.get("restrictEgress") else None)


# --- schemas ----------------------------------------------------------------------------


def _validate(files: list[Path], check: bool) -> list[dict]:
    # The PodGroups `pipejob render` shows for Volcano and coscheduling jobs are checked
    # against the test harness's copies of those CRDs (the chart does not ship them).
    cmd = [
        tools_python(),
        str(ROOT / "scripts" / "validate-manifests.py"),
        "--crds",
        str(ROOT / "crds"),
        "--crds",
        str(CHART / "crds"),
        "--crds",
        str(ROOT / "tests" / "harness" / "crds"),
    ]
    for version in KUBERNETES_VERSIONS:
        cmd += ["--kubernetes-version", version]
    proc = run([*cmd, *map(str, files)], check=check)
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_manifests_match_kubernetes_and_crd_schemas(
    renders: dict[str, Path], pod_renders: dict[str, Path]
) -> None:
    files = [
        *renders.values(),
        *pod_renders.values(),
        *EXAMPLES,
        *sorted((ROOT / "crds").glob("*.yaml")),
        CHART / "crds" / "kopf-peering.yaml",
    ]
    results = _validate(files, check=False)
    problems = [r for r in results if r["errors"]]
    assert not problems, json.dumps(problems, indent=1)
    expected = sum(len(documents(f.read_text())) for f in files)
    assert len(results) == expected, "every document is validated"
    for r in results:
        if r["kind"] in (*KINDS, "KopfPeering", "ClusterKopfPeering", "PodGroup"):
            assert r["schema"] == f"CRD {r['kind']}"
        else:
            assert r["schema"] == "Kubernetes " + ", ".join(KUBERNETES_VERSIONS)


BAD = """\
apiVersion: pipejob.dev/v1alpha1
kind: PipelineJob
metadata: {name: unknown-field}
spec: {stages: 1, modle: resnet50}
---
apiVersion: pipejob.dev/v1alpha1
kind: PipelineJob
metadata: {name: cel-rule}
spec: {batchSize: 30}
---
apiVersion: pipejob.dev/v1alpha1
kind: PipelineJob
metadata: {name: micro-batches-word}
spec: {microBatches: Auto}
---
apiVersion: pipejob.dev/v1alpha1
kind: PipelineJob
metadata: {name: micro-batches-quoted}
spec: {microBatches: "4"}
---
apiVersion: pipejob.dev/v1alpha1
kind: PipelineJob
metadata: {name: micro-batches-zero}
spec: {microBatches: 0}
---
apiVersion: pipejob.dev/v1alpha1
kind: PipelineJob
metadata: {name: micro-batches-auto}
spec: {microBatches: auto, batchSize: 30}
---
apiVersion: pipejob.dev/v1alpha1
kind: HybridJob
metadata: {name: nccl-without-gpus}
spec: {backend: nccl}
---
apiVersion: pipejob.dev/v1alpha1
kind: HybridJob
metadata: {name: a-name-much-too-long-for-the-pods-of-this-job}
---
apiVersion: v1
kind: Pod
metadata: {name: bad-pod}
spec:
  containers: [{name: c, image: x, securityContext: {privileged: "yes"}}]
---
apiVersion: example.com/v1
kind: Unknown
metadata: {name: no-schema}
"""


def test_schema_validation_rejects_bad_manifests(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    results = {r["name"]: r["errors"] for r in _validate([bad], check=False)}
    assert results.keys() == {d["metadata"]["name"] for d in documents(BAD)}
    assert "'modle' was unexpected" in results["unknown-field"][0]
    assert "spec.stages: 1 is less than the minimum of 2" in results["unknown-field"]
    assert results["cel-rule"] == ["spec.microBatches: batchSize must be divisible by microBatches"]
    assert results["micro-batches-word"] == ["spec.microBatches: 'Auto' does not match '^auto$'"]
    assert results["micro-batches-quoted"] == ["spec.microBatches: '4' does not match '^auto$'"]
    assert results["micro-batches-zero"] == ["spec.microBatches: 0 is less than the minimum of 1"]
    assert results["micro-batches-auto"] == []  # valid: auto needs no divisible batch
    assert results["nccl-without-gpus"] == ["spec.backend: backend nccl needs gpusPerTrainer > 0"]
    assert "at most 40 characters" in results["a-name-much-too-long-for-the-pods-of-this-job"][0]
    assert "privileged" in results["bad-pod"][0]
    assert "Couldn't find schema for kind Unknown" in results["no-schema"][0]


# --- Dockerfile, security posture, YAML style -------------------------------------------


def test_hadolint() -> None:
    run([tool("hadolint"), "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "Dockerfile")])


def test_checkov(renders: dict[str, Path], pod_renders: dict[str, Path], tmp_path: Path) -> None:
    """One checkov run over the chart (every check but the justified skips) and the
    examples' pods (the security checks)."""
    for target, paths in (("chart", renders.values()), ("pods", pod_renders.values())):
        (tmp_path / target).mkdir()
        for path in paths:
            (tmp_path / target / path.name).write_text(path.read_text())
    proc = run(
        [
            tool("checkov"),
            "--directory",
            str(tmp_path),
            "--framework",
            "kubernetes",
            "--output",
            "json",
            "--compact",
            "--skip-download",
            "--skip-check",
            ",".join(CHECKOV_SKIPS),
        ],
        timeout=170,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    results = json.loads(proc.stdout)["results"]

    def where(check: dict) -> tuple[str, str, str]:
        path = Path(check["file_path"])
        return path.parent.name, path.name, check["resource"]

    failed = [(c["check_id"], *where(c)) for c in results["failed_checks"]]
    chart_failures = [f for f in failed if f[1] == "chart"]
    assert not chart_failures, chart_failures
    pod_failures = [f for f in failed if f[1] == "pods" and f[0] in SECURITY_CHECKS]
    assert not pod_failures, pod_failures

    passed: dict[tuple[str, str], set[str]] = {}
    for c in results["passed_checks"]:
        passed.setdefault(where(c), set()).add(c["check_id"])
    deployments = [k for k in passed if k[0] == "chart" and k[2].startswith("Deployment.")]
    assert len(deployments) == len(renders)  # one per values set
    for key in deployments:
        assert SECURITY_CHECKS | {READ_ONLY_ROOT} <= passed[key], key
    pods = [k for k in passed if k[0] == "pods" and k[2].startswith("Pod.")]
    expected = sum(len(by_kind(documents(p.read_text()), "Pod")) for p in pod_renders.values())
    assert len(pods) == expected
    for key in pods:
        assert SECURITY_CHECKS <= passed[key], (key, SECURITY_CHECKS - passed[key])


def test_shellcheck() -> None:
    scripts = [
        ROOT / "scripts" / "install-tools.sh",
        ROOT / "tests" / "e2e" / "kind" / "run.sh",
        ROOT / "scripts" / "images.sh",
        ROOT / "scripts" / "standin-base.sh",
        ROOT / ".ci" / "run",
    ]
    run([tool("shellcheck"), *map(str, scripts)])


def test_yamllint() -> None:
    run(
        [
            tool("yamllint"),
            "--strict",
            "--config-file",
            str(ROOT / ".yamllint.yaml"),
            "charts",
            "examples",
            "crds",
            ".github",
        ]
    )


def test_namespace_is_the_releases(renders: dict[str, Path]) -> None:
    """Namespaced chart objects land in the release's namespace (Roles in the watched ones)."""
    for name, path in renders.items():
        for doc in documents(path.read_text()):
            namespace = doc["metadata"].get("namespace")
            if doc["kind"] in ("Role", "RoleBinding", "KopfPeering"):
                assert namespace in CUSTOM_VALUES["watchNamespaces"]
            elif doc["kind"] in ("ServiceAccount", "Service", "Deployment", "NetworkPolicy"):
                assert namespace == NAMESPACE, (name, doc["kind"])
