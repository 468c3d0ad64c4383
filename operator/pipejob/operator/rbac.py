"""Exactly the Kubernetes API permissions the operator uses, and why: the one list the Helm
chart's RBAC is checked against. Calls are made by cluster.py and by kopf (watches, its own
Events, peering); kopf's resource scanning is switched off (controller.py), so it needs no
CustomResourceDefinition or Namespace access."""

from __future__ import annotations

from dataclasses import dataclass

from pipejob.core.kinds import KINDS
from pipejob.core.spec import GROUP

_JOBS = tuple(kind.plural for kind in KINDS.values())


@dataclass(frozen=True)
class Permission:
    group: str  # "" is the core API group
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    why: str


PERMISSIONS: tuple[Permission, ...] = (
    Permission(GROUP, _JOBS, ("list", "watch"), "kopf watches the jobs"),
    Permission(GROUP, _JOBS, ("get",), "each reconcile reads the job afresh"),
    Permission(GROUP, _JOBS, ("delete",), "ttlSecondsAfterFinished deletes a finished job"),
    Permission(GROUP, tuple(f"{p}/status" for p in _JOBS), ("patch",), "the job's status"),
    Permission(
        GROUP,
        tuple(f"{p}/finalizers" for p in _JOBS),
        ("update",),
        "ownerReferences with blockOwnerDeletion on the pods and Service (the API server's"
        " OwnerReferencesPermissionEnforcement admission checks this; no call is made)",
    ),  # fmt: skip
    Permission("", ("pods",), ("list", "watch"), "kopf watches pods; each reconcile lists them"),
    Permission("", ("pods",), ("create", "delete"), "the world's pods"),
    Permission("", ("services",), ("create",), "the job's headless Service"),
    Permission("", ("events",), ("create",), "Events on the jobs (pipejob's and kopf's)"),
)

# Only with `pipejob operator --peering NAME` (several replicas, one active).
PEERING: tuple[Permission, ...] = (
    Permission("kopf.dev", ("kopfpeerings",), ("list", "watch", "patch"),
               "kopf peering within the watched namespaces"),
    Permission("kopf.dev", ("clusterkopfpeerings",), ("list", "watch", "patch"),
               "kopf peering with --all-namespaces"),
)  # fmt: skip


def grants(permissions: tuple[Permission, ...] = PERMISSIONS) -> set[tuple[str, str, str]]:
    """Every (group, resource, verb) the operator needs, flattened."""
    return {(p.group, r, v) for p in permissions for r in p.resources for v in p.verbs}
