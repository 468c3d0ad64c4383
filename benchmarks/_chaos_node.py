"""The stand-in nodes of benchmarks/chaos.py: no trainer runs; every pod it sees is bound to
node hash(name) % NODES and goes Running, and a pod deleted goes GRACE later (its containers
stopping, as a kubelet ends a graceful deletion), so that a world made again finds the old
one's pods still terminating. A world's master stands in for its trainer. It steps at its
job's pace from the newest checkpoint where its pod mounts the job's checkpoint.path (the
claim of that volume: the job's disk, kept across worlds; a pod without it has only its own
filesystem), writes one every checkpoint.everySteps steps, and exits 0 at the last step. The
run's faults change pods through it (`set_status`), so it never revives a pod they ended."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
import zlib
from dataclasses import dataclass

from _chaos_checks import WorkKept
from _cluster import NAMESPACE
from _common import REPO

sys.path.insert(0, str(REPO / "tests"))
from harness.client import Api, ApiError  # the tests' harness lives in tests/

JOB_LABEL = "pipejob.dev/job"
NODES = 4  # pods are on node hash(name) % NODES: a lost node takes its share
GRACE = 0.5  # seconds a deleted pod's containers take to stop


@dataclass
class World:
    """A running master, as its trainer would go: from step `resumed` at `started`."""

    job: str
    place: str  # where its checkpoints go
    started: float
    resumed: int
    every: int
    steps: int


def checkpoint_place(pod: dict) -> tuple[str, int, int]:
    """Where the trainer of `pod` keeps its checkpoints, their interval and the job's steps:
    the claim of the volume mounted at checkpoint.path, else the pod's own filesystem."""
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container.get("env") or []}
    spec = json.loads(env["PIPEJOB_SPEC"])
    checkpoint = spec.get("checkpoint") or {}
    path, every = checkpoint.get("path"), int(checkpoint.get("everySteps") or 10)
    own = f"pod {pod['metadata']['uid']}:{path}"
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    for mount in container.get("volumeMounts") or []:
        claim = (volumes.get(mount["name"], {}).get("persistentVolumeClaim") or {}).get("claimName")
        if path and mount["mountPath"] == path and claim:
            return f"claim {claim}:{path}", every, spec["steps"]
    return own, every, spec["steps"]


class Node:
    """The stand-in node: every pod it sees goes Running; a master steps at its job's `pace`
    (seconds a step), checkpointing as its spec says, and exits 0 at the last step. Faults
    change pods through it, so it never revives one."""

    def __init__(self, api: Api, pace: dict[str, float], work: WorkKept):
        self.api, self.pace, self.work = api, pace, work
        self.pods: dict[str, dict] = {}
        self.worlds: dict[str, World] = {}  # by the master pod's uid
        self.disks: dict[str, int] = {}  # the newest checkpoint's step, by place
        self.stopping: dict[str, float] = {}  # pods being deleted, by uid: since when
        self.lock = threading.Lock()
        self.watch = api.watch("v1/pods", NAMESPACE)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        for event in self.watch:
            pod, kind = event["object"], event["type"]
            with self.lock:
                if kind == "DELETED" or pod["metadata"].get("deletionTimestamp"):
                    self._stop(pod["metadata"]["uid"], time.monotonic())
                if kind == "DELETED":
                    self.pods.pop(pod["metadata"]["name"], None)
                    self.stopping.pop(pod["metadata"]["uid"], None)
                else:
                    self.pods[pod["metadata"]["name"]] = pod

    def _advance(self, uid: str, now: float) -> int:
        """The step a running master has reached by `now`, its checkpoints written."""
        w = self.worlds[uid]
        step = min(w.steps, w.resumed + int((now - w.started) / self.pace.get(w.job, 1.0)))
        self.disks[w.place] = max(self.disks.get(w.place, 0), step // w.every * w.every)
        self.work.step(w.job, step)
        return step

    def _stop(self, uid: str, now: float) -> None:
        if uid in self.worlds:
            self._advance(uid, now)
            del self.worlds[uid]

    def _start(self, pod: dict, now: float) -> None:
        place, every, steps = checkpoint_place(pod)
        job = pod["metadata"]["labels"][JOB_LABEL]
        w = World(job, place, now, self.disks.get(place, 0), every, steps)
        self.worlds[pod["metadata"]["uid"]] = w
        self.work.resumed(job, w.resumed, every)

    def set_status(self, name: str, status: dict, unless_finished: bool = True) -> bool:
        with self.lock:
            pod = self.pods.get(name)
            phase = (pod or {}).get("status", {}).get("phase")
            if pod is None or (unless_finished and phase in ("Succeeded", "Failed")):
                return False
            with contextlib.suppress(ApiError):  # deleted meanwhile
                self.pods[name] = self.api.patch(
                    "v1/pods", name, {"status": status}, NAMESPACE, subresource="status"
                )
                now, uid = time.monotonic(), pod["metadata"]["uid"]
                if status.get("phase") == "Running" and name.endswith("-master-0"):
                    self._start(pod, now)
                elif status.get("phase") != "Running":
                    self._stop(uid, now)
                return True
        return False

    def tick(self, now: float) -> None:
        """Pending pods are bound and start; masters step, and those at their last step
        finish; a deleted pod goes once its containers have had GRACE to stop."""
        for name, pod in self.snapshot().items():
            phase = (pod.get("status") or {}).get("phase") or "Pending"
            if pod["metadata"].get("deletionTimestamp"):
                self._end_deletion(pod, now)
                continue
            if phase == "Pending":
                if self._bind(pod):
                    self.set_status(name, {"phase": "Running"})
                continue
            with self.lock:
                uid = pod["metadata"]["uid"]
                world = self.worlds.get(uid)
                done = world is not None and self._advance(uid, now) >= world.steps
            if done:
                self.set_status(name, ended(0, "Completed"))

    def _bind(self, pod: dict) -> bool:
        """Bind the pod (that very one: by its uid) to its node; False if it went meanwhile."""
        meta = pod["metadata"]
        if pod["spec"].get("nodeName"):
            return True
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": meta["name"], "uid": meta["uid"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node_of(meta["name"])},
        }
        try:
            self.api.request(
                "POST", f"/api/v1/namespaces/{NAMESPACE}/pods/{meta['name']}/binding", binding
            )
        except ApiError:
            return False
        return True

    def _end_deletion(self, pod: dict, now: float) -> None:
        """The kubelet's part of a graceful deletion, GRACE after it began: remove the pod."""
        uid = pod["metadata"]["uid"]
        with self.lock:
            since = self.stopping.setdefault(uid, now)
        if now - since >= GRACE:
            options = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
            with contextlib.suppress(ApiError):  # gone already, or another pod of that name
                self.api.delete("v1/pods", pod["metadata"]["name"], NAMESPACE, options)

    def snapshot(self) -> dict[str, dict]:
        with self.lock:
            return dict(self.pods)


def node_of(pod: str) -> str:
    """The node a pod of that name runs on."""
    return f"node-{zlib.crc32(pod.encode()) % NODES}"


def ended(code: int, reason: str, message: str = "") -> dict:
    terminated = {"exitCode": code, "reason": reason, "message": message}
    terminated["finishedAt"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    state = {"name": "trainer", "state": {"terminated": terminated}}
    return {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [state]}
