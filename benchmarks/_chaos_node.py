"""The stand-in node of benchmarks/chaos.py: no trainer runs; every pod it sees goes Running, and
a world's master exits 0 once it has run its job's training time. The run's faults change
pods through it (`set_status`), so it never revives a pod they ended."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

from _cluster import NAMESPACE
from _common import REPO

sys.path.insert(0, str(REPO / "tests"))
from harness.client import Api, ApiError  # noqa: E402  (the tests' harness lives in tests/)


class Node:
    """The stand-in node: every pod it sees goes Running; a master that ran its job's
    training time exits 0. Faults change pods through it, so it never revives one."""

    def __init__(self, api: Api, train: dict[str, float]):
        self.api, self.train = api, train
        self.pods: dict[str, dict] = {}
        self.started: dict[str, float] = {}  # when each pod (by uid) went Running
        self.lock = threading.Lock()
        self.watch = api.watch("v1/pods", NAMESPACE)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        for event in self.watch:
            pod, kind = event["object"], event["type"]
            with self.lock:
                if kind == "DELETED":
                    self.pods.pop(pod["metadata"]["name"], None)
                else:
                    self.pods[pod["metadata"]["name"]] = pod

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
                return True
        return False

    def tick(self, now: float) -> None:
        """Pending pods start; masters that trained long enough finish."""
        for name, pod in self.snapshot().items():
            phase = (pod.get("status") or {}).get("phase") or "Pending"
            if pod["metadata"].get("deletionTimestamp"):
                continue
            uid = pod["metadata"]["uid"]
            if phase == "Pending" and self.set_status(name, {"phase": "Running"}):
                self.started[uid] = now
            elif phase == "Running" and name.endswith("-master-0"):
                job = pod["metadata"]["labels"]["pipejob.dev/job"]
                if now - self.started.get(uid, now) >= self.train.get(job, 10):
                    self.set_status(name, ended(0, "Completed"))

    def snapshot(self) -> dict[str, dict]:
        with self.lock:
            return dict(self.pods)


def ended(code: int, reason: str, message: str = "") -> dict:
    terminated = {"exitCode": code, "reason": reason, "message": message}
    terminated["finishedAt"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    state = {"name": "trainer", "state": {"terminated": terminated}}
    return {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [state]}
