"""Exactly the Kubernetes API permissions the operator uses, and why: the one list the Helm
chart's RBAC is checked against. Calls are made by cluster.py and by kopf (watches, its own
Events, peering); kopf's resource scanning is switched off (controller.py), so it needs no
CustomResourceDefinition or Namespace access."""

from __future__ import annotations

from dataclasses import dataclass

from pipejob.core.kinds import KINDS
from pipejob.core.spec import GROUP


@dataclass(frozen=True)
class Permission:
    group: str  # "" is the core API group
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    why: str


def permissions() -> tuple[Permission, ...]:
    """What the operator always needs, for every kind in the registry."""
    jobs = tuple(kind.plural for kind in KINDS.values())
    return (
        Permission(GROUP, jobs, ("list", "watch"), "kopf watches the jobs; the resync lists them"),
        Permission(GROUP, jobs, ("get",), "each reconcile reads the job afresh"),
        Permission(GROUP, jobs, ("delete",), "ttlSecondsAfterFinished deletes a finished job"),
        Permission(GROUP, tuple(f"{p}/status" for p in jobs), ("patch",), "the job's status"),
        Permission(
            GROUP,
            tuple(f"{p}/finalizers" for p in jobs),
            ("update",),
            "ownerReferences with blockOwnerDeletion on the pods and Service (the API server's"
            " OwnerReferencesPermissionEnforcement admission checks this; no call is made)",
        ),
        Permission(
            "",
            ("pods",),
            ("list", "watch"),
            "kopf watches pods; each reconcile lists its job's, the resync every job's",
        ),
        Permission("", ("pods",), ("create", "delete"), "the world's pods"),
        Permission("", ("services",), ("create",), "the job's headless Service"),
        Permission("", ("events",), ("create",), "Events on the jobs (pipejob's and kopf's)"),
    )


# Only with `pipejob operator --peering NAME` (several replicas, one active).
PEERING: tuple[Permission, ...] = (
    Permission(
        "kopf.dev",
        ("kopfpeerings",),
        ("list", "watch", "patch"),
        "kopf peering within the watched namespaces",
    ),
    Permission(
        "kopf.dev",
        ("clusterkopfpeerings",),
        ("list", "watch", "patch"),
        "kopf peering with --all-namespaces",
    ),
)


# Only with the chart's networkPolicy.jobs.enabled (the default): a NetworkPolicy per world.
NETWORK_POLICIES: tuple[Permission, ...] = (
    Permission(
        "networking.k8s.io",
        ("networkpolicies",),
        ("create", "patch"),
        "the NetworkPolicy of each job's world (patched to a new world's when it differs)",
    ),
)


# Only with the chart's scheduling integrations on (spec.scheduling of the jobs).
KUEUE: tuple[Permission, ...] = (
    Permission(
        "",
        ("pods",),
        ("patch",),
        "kueue: mark a failed job's pods retriable-in-group=false, ending its pod group",
    ),
)
VOLCANO: tuple[Permission, ...] = (
    Permission(
        "scheduling.volcano.sh",
        ("podgroups",),
        ("create", "patch"),
        "volcano: the PodGroup of the job's world (patched when the spec changes)",
    ),
)
COSCHEDULING: tuple[Permission, ...] = (
    Permission(
        "scheduling.x-k8s.io",
        ("podgroups",),
        ("create", "patch"),
        "coscheduling: the PodGroup of the job's world (patched when the spec changes)",
    ),
)
SCHEDULING = {"kueue": KUEUE, "volcano": VOLCANO, "coscheduling": COSCHEDULING}


def grants(needed: tuple[Permission, ...] | None = None) -> set[tuple[str, str, str]]:
    """Every (group, resource, verb) of `needed` (default: what the operator always needs),
    flattened."""
    needed = permissions() if needed is None else needed
    return {(p.group, r, v) for p in needed for r in p.resources for v in p.verbs}
