"""What a pod says about itself: its phase, whether it is going, why its container waits,
and what its trainer left when it ended."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pipejob.core.contract import MAX_MESSAGE
from pipejob.core.k8s import KubeObject
from pipejob.operator.status.job_status import RoleCounts


def pod_phase(pod: KubeObject) -> str:
    return (pod.get("status") or {}).get("phase") or "Pending"


def scheduled_message(pod: KubeObject) -> str:
    """What the scheduler said about a pod it has not placed (its PodScheduled condition)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return ": ".join(filter(None, (c.get("reason"), c.get("message"))))
    return ""


def waiting_message(pod: KubeObject) -> str:
    """Why a pod's container has not started (its waiting state: ErrImagePull,
    ImagePullBackOff, CreateContainerConfigError, ...), or "" when it is only being made."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
            return tail(": ".join(filter(None, (waiting.get("reason"), waiting.get("message")))))
    return ""


def deleting(pod: KubeObject) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def terminated(pod: KubeObject) -> bool:
    return pod_phase(pod) in ("Succeeded", "Failed")


def role_counts(
    pods: Iterable[KubeObject], role_of: Callable[[KubeObject], str]
) -> dict[str, RoleCounts]:
    """{role: {pending, running, succeeded, failed}} over `pods`."""
    counts: dict[str, RoleCounts] = {}
    for pod in pods:
        phase = pod_phase(pod).lower()
        row = counts.setdefault(
            role_of(pod), {"pending": 0, "running": 0, "succeeded": 0, "failed": 0}
        )
        row[phase if phase in row else "pending"] += 1  # type: ignore[literal-required]
    return counts


def trainer_state(pod: KubeObject) -> KubeObject:
    """The pod's terminated container state (Kubernetes' ContainerStateTerminated), or {}."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated_state = (cs.get("state") or {}).get("terminated")
        if terminated_state:
            return terminated_state
    return {}


def tail(text: str, limit: int = MAX_MESSAGE) -> str:
    """The end of a log tail is where the error is."""
    return text if len(text) <= limit else "..." + text[-limit:]
