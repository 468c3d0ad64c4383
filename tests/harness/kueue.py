"""Kueue's part for plain-pod groups, played as its documents say (KEP-976 "Plain Pods", "Run
Plain Pods", the pod controller's semantics), for the emulated cluster:

- the webhook: a pod labelled `kueue.x-k8s.io/queue-name` is created gated by
  `kueue.x-k8s.io/admission`, with the finalizer and label `kueue.x-k8s.io/managed`;
- admission: a group (`kueue.x-k8s.io/pod-group-name`) is admitted only once as many runnable
  pods as its `kueue.x-k8s.io/pod-group-total-count` exist and its LocalQueue has quota for
  them all; then every gated pod of it is ungated (replacements too, while it stays admitted);
- Kueue never recreates pods; it removes its finalizer from pods that are done with (terminated
  and deleted, or deleted before they were bound) and from every pod once the group finishes:
  every pod succeeded, or none is active and one is annotated `retriable-in-group: "false"`;
- preemption (`preempt`): every active pod of the group gets the DisruptionTarget condition
  and is deleted; the group goes back to the queue, its quota released.

Quota is counted in pods per LocalQueue (`queues`: name -> pods admitted at once, None for no
limit); a queue that is not listed does not exist, and its groups wait. Not emulated: excess
pods, fast admission, flavors, workload priority."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from harness import apiserver
from harness.apiserver import now
from harness.client import ApiError
from harness.cluster import Cluster
from harness.controller import Controller

QUEUE = "kueue.x-k8s.io/queue-name"
GROUP = "kueue.x-k8s.io/pod-group-name"
TOTAL = "kueue.x-k8s.io/pod-group-total-count"
RETRIABLE = "kueue.x-k8s.io/retriable-in-group"
GATE = "kueue.x-k8s.io/admission"
MANAGED = "kueue.x-k8s.io/managed"  # the label and the finalizer

PODS = "v1/pods"
Key = tuple[str, str]  # (namespace, group)


@dataclass
class Workload:
    """What Kueue's Workload of one pod group records."""

    queue: str
    total: int
    admitted: bool = False
    finished: bool = False
    succeeded: bool = False  # finished with every pod Succeeded
    admissions: int = 0
    evictions: int = 0
    ungated: list[str] = field(default_factory=list)  # pods, in the order admitted


class Kueue(Controller):
    name = "kueue"

    def __init__(self, cluster: Cluster, queues: dict[str, int | None], every: float = 0.1):
        super().__init__(every)
        self.api = cluster.api
        self.queues = dict(queues)
        self.workloads: dict[Key, Workload] = {}
        self._lock = threading.Lock()
        cluster.mutators.append(self._webhook)

    # --- the webhook: runs inside the API server, so it must not call the API ---------------

    @staticmethod
    def _webhook(resource: Any, pod: dict) -> None:
        labels = pod["metadata"].get("labels") or {}
        if resource != apiserver.PODS or QUEUE not in labels:
            return
        pod["metadata"]["labels"][MANAGED] = "true"
        pod["metadata"]["finalizers"] = [*(pod["metadata"].get("finalizers") or []), MANAGED]
        spec = pod.setdefault("spec", {})
        spec["schedulingGates"] = [*(spec.get("schedulingGates") or []), {"name": GATE}]
        pod["status"]["conditions"] = [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "SchedulingGated",
                "message": "Scheduling is blocked due to non-empty scheduling gates",
                "lastTransitionTime": now(),
            }
        ]

    # --- what tests use -----------------------------------------------------------------------

    def workload(self, namespace: str, group: str) -> Workload | None:
        with self._lock:
            return self.workloads.get((namespace, group))

    def preempt(
        self,
        namespace: str,
        group: str,
        message: str = "Preempted to accommodate a higher priority Workload",
    ) -> list[str]:
        """Evict the group as Kueue's preemption does; returns the pods it deleted."""
        with self._lock:
            workload = self.workloads[(namespace, group)]
            workload.admitted = False
            workload.evictions += 1
        stopped = []
        for pod in self._members(namespace, group):
            meta = pod["metadata"]
            if meta.get("deletionTimestamp") or _terminated(pod) or _gated(pod):
                continue
            conditions = [
                *(pod["status"].get("conditions") or []),
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "Preempted",
                    "message": message,
                    "lastTransitionTime": now(),
                },
            ]
            self._write(
                self.api.patch,
                PODS,
                meta["name"],
                {"status": {"conditions": conditions}},
                namespace,
                subresource="status",
            )
            self._write(self.api.delete, PODS, meta["name"], namespace)
            stopped.append(meta["name"])
        return stopped

    # --- the pod-group controller -------------------------------------------------------------

    def _members(self, namespace: str, group: str) -> list[dict]:
        return self.api.list(PODS, namespace, labelSelector=f"{GROUP}={group},{MANAGED}=true")

    def _tick(self) -> None:
        groups: dict[Key, list[dict]] = {}
        for pod in self.api.list(PODS, labelSelector=f"{GROUP},{MANAGED}=true"):
            meta = pod["metadata"]
            groups.setdefault((meta["namespace"], meta["labels"][GROUP]), []).append(pod)
        for key, pods in groups.items():
            self._reconcile(key, pods)

    def _reconcile(self, key: Key, pods: list[dict]) -> None:
        first = pods[0]["metadata"]
        with self._lock:
            workload = self.workloads.setdefault(
                key, Workload(first["labels"][QUEUE], int(first["annotations"][TOTAL]))
            )
        if not workload.finished:
            succeeded = sum(1 for p in pods if p["status"].get("phase") == "Succeeded")
            unretriable = any(_annotation(p, RETRIABLE) == "false" for p in pods)
            if succeeded >= workload.total or (
                unretriable and not any(not _terminated(p) for p in pods)
            ):
                with self._lock:
                    workload.finished, workload.admitted = True, False
                    workload.succeeded = succeeded >= workload.total
        for pod in pods:
            deleting = bool(pod["metadata"].get("deletionTimestamp"))
            done = deleting and (_terminated(pod) or not pod["spec"].get("nodeName"))
            if MANAGED in (pod["metadata"].get("finalizers") or []) and (workload.finished or done):
                self._finalize(pod)
        if workload.finished:
            return
        if not workload.admitted and sum(1 for p in pods if _runnable(p)) >= workload.total:
            with self._lock:
                if self._fits(workload):
                    workload.admitted = True
                    workload.admissions += 1
        if workload.admitted:
            for pod in pods:
                if _gated(pod) and not pod["metadata"].get("deletionTimestamp"):
                    self._ungate(pod)
                    with self._lock:
                        workload.ungated.append(pod["metadata"]["name"])

    def _fits(self, workload: Workload) -> bool:
        if workload.queue not in self.queues:
            return False  # no such LocalQueue
        quota = self.queues[workload.queue]
        used = sum(
            w.total for w in self.workloads.values() if w.admitted and w.queue == workload.queue
        )
        return quota is None or used + workload.total <= quota

    def _ungate(self, pod: dict) -> None:
        meta = pod["metadata"]
        gates = [g for g in pod["spec"].get("schedulingGates") or [] if g.get("name") != GATE]
        patch = {"spec": {"schedulingGates": gates or None}}
        self._write(self.api.patch, PODS, meta["name"], patch, meta["namespace"])

    def _finalize(self, pod: dict) -> None:
        meta = pod["metadata"]
        rest = [f for f in meta.get("finalizers") or [] if f != MANAGED]
        self._write(
            self.api.patch,
            PODS,
            meta["name"],
            {"metadata": {"finalizers": rest or None}},
            meta["namespace"],
        )

    @staticmethod
    def _write(call: Any, *args: Any, **kwargs: Any) -> None:
        try:
            call(*args, **kwargs)
        except ApiError as e:
            if e.status != 404:  # gone meanwhile: nothing to do
                raise


def _annotation(pod: dict, key: str) -> str | None:
    return (pod["metadata"].get("annotations") or {}).get(key)


def _gated(pod: dict) -> bool:
    return any(g.get("name") == GATE for g in pod["spec"].get("schedulingGates") or [])


def _terminated(pod: dict) -> bool:
    return pod["status"].get("phase") in ("Succeeded", "Failed")


def _runnable(pod: dict) -> bool:
    """Kueue's "runnable or succeeded": not Failed, and not deleted before it was bound."""
    if pod["metadata"].get("deletionTimestamp") and not pod["spec"].get("nodeName"):
        return False
    return pod["status"].get("phase") != "Failed"
