"""A member killed for memory (OOMKilled), and the memory its role gets next: which pod of the
current world the kernel killed, what its role had and should have, and the world's pods with
the raised memory that status.memory holds (spec.oom, core/oom.py). Pure; the situation that
acts on them is situations.oom_killed."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING

from pipejob.core import oom
from pipejob.core.k8s import KubeObject, quantity
from pipejob.operator import kube
from pipejob.operator import status as st

if TYPE_CHECKING:  # observation.py reads with_raised_memory
    from pipejob.operator.observation import Observed

OOM_KILLED = "OOMKilled"  # the container's terminated reason the kubelet reports


@dataclass(frozen=True)
class Kill:
    """One OOM kill: the pod, its process's name, its role, the memory it had, and the memory
    its role gets next (equal to `had` at the cap)."""

    pod: str
    process: str
    role: str
    had: Decimal
    next: Decimal


def kill(seen: Observed) -> Kill | None:
    """The first (by finishing time, then rank) pod of the current world killed for memory,
    when its role's memory is known (the template gives some); else None."""
    found = []
    for rank, planned_pod in enumerate(seen.planned):
        observed = seen.by_name.get(planned_pod["metadata"]["name"])
        if observed is None or st.pod_phase(observed) != "Failed":
            continue
        state = st.trainer_state(observed)
        if state.get("reason") == OOM_KILLED:
            found.append((state.get("finishedAt") or "~", rank, planned_pod))
    if not found:
        return None
    planned_pod = min(found, key=lambda f: f[:2])[2]
    had = pod_memory(planned_pod)
    if had is None:  # no memory of its own: the node ran out, nothing to raise
        return None
    name = planned_pod["metadata"]["name"]
    process, role = kube.process_name(planned_pod), kube.role_of(planned_pod)
    return Kill(name, process, role, had, max(had, seen.job.control.oom.raised(had)))


def pod_memory(pod: KubeObject) -> Decimal | None:
    """The memory a planned pod's trainer container has: its limit, else its request."""
    resources = pod["spec"]["containers"][0].get("resources") or {}
    for key in ("limits", "requests"):
        value = (resources.get(key) or {}).get(oom.MEMORY)
        if value is not None:
            return quantity(value)
    return None


def with_raised_memory(pods: list[KubeObject], raised: dict[str, str] | None) -> list[KubeObject]:
    """`pods` with the memory of each role in `raised` (status.memory) in place of the
    template's, where it is more: the limit set to it, the request grown in proportion."""
    if not raised:
        return pods
    out = []
    for pod in pods:
        want, had = raised.get(kube.role_of(pod)), pod_memory(pod)
        if want is None or had is None or quantity(want) <= had:
            out.append(pod)
            continue
        pod = copy.deepcopy(pod)
        resources = pod["spec"]["containers"][0]["resources"]
        for key in ("limits", "requests"):
            section = resources.get(key) or {}
            if oom.MEMORY in section:
                grown = quantity(section[oom.MEMORY]) * quantity(want) / had
                section[oom.MEMORY] = oom.text(_mib_up(grown))
        out.append(pod)
    return out


def _mib_up(amount: Decimal) -> Decimal:
    mib = Decimal(2**20)
    return (amount / mib).to_integral_value(rounding="ROUND_CEILING") * mib
