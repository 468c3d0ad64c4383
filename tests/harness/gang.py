"""A gang scheduler for the emulated cluster, played as Volcano and the coscheduling plugin
(kubernetes-sigs/scheduler-plugins) document theirs: it places only the pods that name it
(`spec.schedulerName`), and those of one PodGroup all at once, once the PodGroup exists and at
least its `minMember` pods are pending; until then they stay Pending with a PodScheduled
condition saying why, and the PodGroup's `status.phase` is Pending (Running once placed).

A pod's PodGroup: Volcano's `scheduling.k8s.io/group-name` annotation; coscheduling's
`scheduling.x-k8s.io/pod-group` label. The PodGroup CRDs the API server serves are the minimal
ones in tests/harness/crds/. Not emulated: queues' capacity, minResources, timeouts, backfill."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from harness.apiserver import now
from harness.client import Api, ApiError, path
from harness.controller import Controller

CRDS = Path(__file__).resolve().parent / "crds"
PODS = "v1/pods"


@dataclass(frozen=True)
class Flavour:
    scheduler: str  # the schedulerName it serves
    podgroups: str  # the PodGroup resource, as the client names it
    crd: str  # file in CRDS
    annotation: str | None = None  # a pod names its group here...
    label: str | None = None  # ...or here

    def group_of(self, pod: dict) -> str | None:
        meta = pod["metadata"]
        if self.annotation:
            return (meta.get("annotations") or {}).get(self.annotation)
        return (meta.get("labels") or {}).get(self.label or "")


VOLCANO = Flavour(
    "volcano",
    "scheduling.volcano.sh/v1beta1/podgroups",
    "volcano-podgroups.yaml",
    annotation="scheduling.k8s.io/group-name",
)
COSCHEDULING = Flavour(
    "scheduler-plugins-scheduler",
    "scheduling.x-k8s.io/v1alpha1/podgroups",
    "coscheduling-podgroups.yaml",
    label="scheduling.x-k8s.io/pod-group",
)


def crd(flavour: Flavour) -> dict:
    return yaml.safe_load((CRDS / flavour.crd).read_text())


class GangScheduler(Controller):
    name = "gang"

    def __init__(self, api: Api, flavour: Flavour, node: str, every: float = 0.1):
        super().__init__(every)
        self.api = api
        self.flavour = flavour
        self.node = node
        self.placements: dict[tuple[str, str], list[list[str]]] = {}  # group -> pods per round

    def _tick(self) -> None:
        pending: dict[tuple[str, str], list[dict]] = {}
        placed: dict[tuple[str, str], int] = {}
        for pod in self.api.list(PODS):
            spec, meta = pod["spec"], pod["metadata"]
            group = self.flavour.group_of(pod)
            if spec.get("schedulerName") != self.flavour.scheduler or group is None:
                continue
            key = (meta["namespace"], group)
            if spec.get("nodeName"):
                if pod["status"].get("phase") not in ("Succeeded", "Failed"):
                    placed[key] = placed.get(key, 0) + 1
            elif not meta.get("deletionTimestamp") and not spec.get("schedulingGates"):
                pending.setdefault(key, []).append(pod)
        for key, pods in pending.items():
            self._schedule(key, pods, placed.get(key, 0))

    def _schedule(self, key: tuple[str, str], pods: list[dict], placed: int) -> None:
        namespace, name = key
        group = self.api.find(self.flavour.podgroups, name, namespace)
        if group is None:
            why = f"podgroup {namespace}/{name} not found"
        else:
            need = int(group.get("spec", {}).get("minMember") or 1)
            if placed + len(pods) >= need:
                for pod in pods:
                    self._bind(pod)
                self.placements.setdefault(key, []).append(
                    sorted(p["metadata"]["name"] for p in pods)
                )
                self._phase(group, "Running")
                return
            why = f"pod group is not ready, {len(pods)} Pending, {placed} placed, {need} minMember"
            self._phase(group, "Pending")
        for pod in pods:
            self._unschedulable(pod, why)

    def _bind(self, pod: dict) -> None:
        meta = pod["metadata"]
        try:
            self.api.request(
                "POST",
                path(PODS, meta["namespace"], meta["name"], "binding"),
                {
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {"name": meta["name"]},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": self.node},
                },
            )
        except ApiError as e:
            if e.status not in (404, 409):  # deleted, or bound, meanwhile
                raise

    def _phase(self, group: dict, phase: str) -> None:
        if (group.get("status") or {}).get("phase") != phase:
            meta = group["metadata"]
            self.api.patch(
                self.flavour.podgroups,
                meta["name"],
                {"status": {"phase": phase}},
                meta["namespace"],
                subresource="status",
            )

    def _unschedulable(self, pod: dict, why: str) -> None:
        conditions = pod["status"].get("conditions") or []
        if any(c.get("type") == "PodScheduled" and c.get("message") == why for c in conditions):
            return
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": why,
            "lastTransitionTime": now(),
        }
        meta = pod["metadata"]
        try:
            self.api.patch(
                PODS,
                meta["name"],
                {"status": {"conditions": [condition]}},
                meta["namespace"],
                subresource="status",
            )
        except ApiError as e:
            if e.status != 404:
                raise
