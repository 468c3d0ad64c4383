"""What gang admission (spec.scheduling) adds to a job's objects: the labels, annotations and
scheduler of its pods, and, for Volcano and coscheduling, the PodGroup of its world. Pure,
like kube.py, which calls it; docs/user-guide.md, "Gang scheduling", tells what a user sees."""

from __future__ import annotations

import copy
from decimal import Decimal

from pipejob.core import scheduling as sch
from pipejob.core.k8s import KubeObject, quantity
from pipejob.core.spec import Job


def provider(job: Job) -> str | None:
    section = job.control.scheduling
    return section.provider if section else None


def group_name(job: Job) -> str:
    """The Kueue pod group's or the PodGroup's name: the job's. A Kueue pod group has one
    size for life, so each resize of an elastic world (job.resizes) makes a new one; a
    PodGroup is updated in place."""
    if provider(job) == sch.KUEUE and job.resizes:
        return f"{job.name}-{job.resizes}"
    return job.name


def pod_name(job: Job, hostname: str, world: int) -> str:
    """Under Kueue, names unique per world (`<hostname>-r<world>`); else the hostname.

    Kueue's plain-pod group is the job (one name for every world of one size, so a restarted
    world's pods are the replacements Kueue expects); its pods' names carry the world's number,
    since a pod Kueue finalizes lingers while it terminates, while their hostnames, and so the
    world's DNS names, stay fixed."""
    return f"{hostname}-r{world}" if provider(job) == sch.KUEUE else hostname


def decorate(job: Job, pod: KubeObject, size: int) -> KubeObject:
    """`pod` (one of a world of `size`) as its gang scheduler wants it."""
    section = job.control.scheduling
    if section is None:
        return pod
    meta, spec = pod["metadata"], pod["spec"]
    labels, annotations = meta.setdefault("labels", {}), meta.setdefault("annotations", {})
    kind = section.provider
    if kind == sch.KUEUE:
        labels[sch.KUEUE_QUEUE_LABEL] = section.queue
        labels[sch.KUEUE_GROUP_LABEL] = group_name(job)
        annotations[sch.KUEUE_TOTAL_COUNT] = str(size)
        annotations.update(section.topology_annotation)
    elif kind == sch.VOLCANO:
        annotations[sch.VOLCANO_GROUP_ANNOTATION] = group_name(job)
    else:
        labels[sch.COSCHEDULING_GROUP_LABEL] = group_name(job)
    scheduler = section.scheduler_name or sch.DEFAULT_SCHEDULERS.get(kind)
    if scheduler:
        spec["schedulerName"] = scheduler
    if section.priority_class_name:
        spec["priorityClassName"] = section.priority_class_name
    return pod


def podgroup(
    job: Job, pods: list[KubeObject], namespace: str, owner: KubeObject | None
) -> KubeObject | None:
    """The PodGroup of the world `pods` (Volcano or coscheduling), or None."""
    section = job.control.scheduling
    if section is None or section.provider == sch.KUEUE:
        return None
    meta: KubeObject = {
        "name": group_name(job),
        "namespace": namespace,
        "labels": {"pipejob.dev/job": job.name, "app.kubernetes.io/managed-by": "pipejob"},
    }
    if owner is not None:
        meta["ownerReferences"] = [copy.deepcopy(owner)]
    spec: KubeObject = {"minMember": len(pods)}
    if section.provider == sch.VOLCANO:
        group, version, _ = sch.VOLCANO_API
        resources = requests(pods)
        if resources:
            spec["minResources"] = resources
        if section.queue:
            spec["queue"] = section.queue
        if section.priority_class_name:
            spec["priorityClassName"] = section.priority_class_name
    else:
        group, version, _ = sch.COSCHEDULING_API
        if section.schedule_timeout_seconds:
            spec["scheduleTimeoutSeconds"] = section.schedule_timeout_seconds
    return {"apiVersion": f"{group}/{version}", "kind": "PodGroup", "metadata": meta, "spec": spec}


def requests(pods: list[KubeObject]) -> dict[str, str]:
    """The sum of the pods' resource requests (a limit alone counts as its request, as the
    API server defaults it), as Kubernetes quantities."""
    total: dict[str, Decimal] = {}
    for pod in pods:
        for container in pod["spec"].get("containers") or []:
            resources = container.get("resources") or {}
            wanted = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
            for name, amount in wanted.items():
                total[name] = total.get(name, Decimal(0)) + quantity(amount)
    return {name: _format(value) for name, value in sorted(total.items())}


def _format(value: Decimal) -> str:
    if value == value.to_integral_value():
        return str(int(value))
    return f"{int((value * 1000).to_integral_value(rounding='ROUND_CEILING'))}m"
