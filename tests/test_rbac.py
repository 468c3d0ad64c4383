"""The chart's RBAC grants exactly what the operator uses (operator/pipejob/rbac.py): every
permission it lists, nothing more, in the right scope for each way of installing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from static_tools import NAMESPACE, documents, helm_template

from pipejob.operator import rbac

pytestmark = pytest.mark.timeout(60)

WATCHED = ["ml-team", "research"]

Grant = tuple[str, str, str]  # (API group, resource, verb)
# What the chart grants by default: a NetworkPolicy per world is on unless turned off.
DEFAULT = frozenset(rbac.grants() | rbac.grants(rbac.NETWORK_POLICIES))


def _peering(resource: str) -> set[Grant]:
    """kopf's peering permissions on one of its two peering resources."""
    return {g for g in rbac.grants(rbac.PEERING) if g[1] == resource}


def grants_of(role: dict[str, Any]) -> set[Grant]:
    out = set()
    for rule in role.get("rules") or []:
        assert not rule.get("resourceNames"), "rules are per resource type"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    out.add((group, resource, verb))
    return out


def render(values: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    return documents(helm_template(values, tmp_path))


def _service_account(docs: list[dict]) -> str:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]["serviceAccountName"]


def _check_binding(binding: dict, role: dict, docs: list[dict]) -> None:
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": role["kind"],
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": _service_account(docs), "namespace": NAMESPACE}
    ]


@pytest.mark.parametrize("replicas", [1, 2])
def test_all_namespaces_one_cluster_role(replicas: int, tmp_path: Path) -> None:
    docs = render({"replicas": replicas}, tmp_path)
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    expected = DEFAULT
    if replicas > 1:
        expected |= _peering("clusterkopfpeerings")
    assert grants_of(role) == expected
    _check_binding(binding, role, docs)


@pytest.mark.parametrize("peering", [False, True])
def test_namespace_list_one_role_each(peering: bool, tmp_path: Path) -> None:
    docs = render({"watchNamespaces": WATCHED, "peering": {"enabled": peering}}, tmp_path)
    assert not [d for d in docs if d["kind"].startswith("Cluster")], "nothing cluster-wide"
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role"}
    bindings = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "RoleBinding"}
    assert sorted(roles) == sorted(bindings) == sorted(WATCHED)
    expected = DEFAULT
    if peering:
        expected |= _peering("kopfpeerings")
    for namespace, role in roles.items():
        assert grants_of(role) == expected, namespace
        _check_binding(bindings[namespace], role, docs)


INTEGRATIONS = ["kueue", "volcano", "coscheduling"]


@pytest.mark.parametrize("enabled", [[name] for name in INTEGRATIONS] + [INTEGRATIONS])
@pytest.mark.parametrize("watch", [[], WATCHED])
def test_each_scheduling_integration_adds_exactly_its_permissions(
    enabled: list[str], watch: list[str], tmp_path: Path
) -> None:
    values = {
        "watchNamespaces": watch,
        "scheduling": {name: {"enabled": name in enabled} for name in INTEGRATIONS},
    }
    docs = render(values, tmp_path)
    roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    assert len(roles) == max(1, len(watch))
    expected = DEFAULT
    for name in enabled:
        expected |= rbac.grants(rbac.SCHEDULING[name])
    for role in roles:
        assert grants_of(role) == expected, role["metadata"]


@pytest.mark.parametrize("watch", [[], WATCHED])
def test_turning_the_jobs_network_policies_off_takes_exactly_their_permissions(
    watch: list[str], tmp_path: Path
) -> None:
    values = {"watchNamespaces": watch, "networkPolicy": {"jobs": {"enabled": False}}}
    roles = [d for d in render(values, tmp_path) if d["kind"] in ("Role", "ClusterRole")]
    assert roles and all(grants_of(role) == rbac.grants() for role in roles)
    assert rbac.grants(rbac.NETWORK_POLICIES) == {
        ("networking.k8s.io", "networkpolicies", "create"),
        ("networking.k8s.io", "networkpolicies", "patch"),
    }  # made with each world, patched to a new world's; deleted by the job's owner reference


def test_scheduling_permissions_are_off_by_default(tmp_path: Path) -> None:
    (role,) = [d for d in render({}, tmp_path) if d["kind"] == "ClusterRole"]
    for permissions in rbac.SCHEDULING.values():
        assert not (rbac.grants(permissions) - rbac.grants()) & grants_of(role)


def test_no_secrets_no_wildcards_no_escalation(tmp_path: Path) -> None:
    everything = {"scheduling": {name: {"enabled": True} for name in INTEGRATIONS}}
    for values in (
        {"replicas": 2, **everything},
        {"watchNamespaces": WATCHED, "replicas": 2, **everything},
    ):
        for doc in render(values, tmp_path):
            if doc["kind"] in ("Role", "ClusterRole"):
                for group, resource, verb in grants_of(doc):
                    assert "*" not in (group, resource, verb)
                    assert resource not in ("secrets", "configmaps", "pods/exec")
                    assert verb not in ("escalate", "bind", "impersonate")
            if doc["kind"] in ("RoleBinding", "ClusterRoleBinding"):
                assert doc["roleRef"]["name"] not in ("cluster-admin", "admin", "edit")
