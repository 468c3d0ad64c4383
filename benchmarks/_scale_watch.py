"""What operator_scale.py watches and stands in for: the jobs' phases (a refusal ends the run),
the pods as a watch first sees them, the stand-in node that reports each Running, and the
stand-in master at their podIP that answers the operator's /progress polls as a master past its
own check."""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time

from _cluster import NAMESPACE

from harness import jobs
from harness.client import Api, ApiError
from harness.standin import StandInMaster
from pipejob.core.contract import Progress
from pipejob.core.kinds import KINDS
from pipejob.operator import kube


class Refused(Exception):
    """The operator failed a job the benchmark made: the run cannot measure what it meant to."""


# What the stand-in master answers: a report of a master past its check (master_first.checked).
CHECKED = Progress(step=0, steps=3, phase="preflight").to_json()


def stand_in_master() -> StandInMaster:
    """The master every pod's podIP reaches: at the monitor port (where the operator polls) of a
    127.x.y.z address of its own, so that runs beside this one do not meet it."""
    for _ in range(50):
        host = f"127.{random.randint(2, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
        with contextlib.suppress(OSError):  # taken
            master = StandInMaster(host, kube.PORTS.monitor)
            master.answer(CHECKED)
            return master
    raise OSError(f"no free 127.x.y.z address for a stand-in master at {kube.PORTS.monitor}")


class JobWatch:
    """When each job of both kinds first reached Running, and the first job the operator
    failed (a refusal: InvalidSpec, or any other reason), with its message."""

    def __init__(self, api: Api):
        self.running: dict[str, float] = {}
        self.failed: tuple[str, str] | None = None
        self.watches = [api.watch(jobs.resource(kind), NAMESPACE) for kind in KINDS]
        for watch in self.watches:
            threading.Thread(target=self._run, args=(watch,), daemon=True).start()

    def _run(self, watch) -> None:
        for event in watch:
            obj = event.get("object") or {}
            status, name = obj.get("status") or {}, obj.get("metadata", {}).get("name")
            if status.get("phase") == "Running":
                self.running.setdefault(name, time.perf_counter())
            elif status.get("phase") == "Failed" and self.failed is None:
                why = next(
                    (
                        c.get("message")
                        for c in status.get("conditions") or []
                        if c["type"] == "Failed"
                    ),
                    "",
                )
                self.failed = (f"{obj.get('kind')} {name}", why)

    def check(self) -> None:
        if self.failed is not None:
            raise Refused(f"the operator failed {self.failed[0]}: {self.failed[1]}")

    def close(self) -> None:
        for watch in self.watches:
            watch.close()


class PodWatch:
    """Records when each pod is first seen by a watch, and wakes waiters."""

    def __init__(self, api: Api, jobs_seen: JobWatch, master: StandInMaster):
        self.api, self.jobs_seen, self.master = api, jobs_seen, master
        self.running = {"status": {"phase": "Running", "podIP": master.host}}
        self.seen: dict[str, float] = {}
        self.changed = threading.Condition()
        self.starting: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.watch = api.watch("v1/pods", NAMESPACE)
        for run in (self._run, self._node):
            threading.Thread(target=run, daemon=True).start()

    def _run(self) -> None:
        for event in self.watch:
            if event.get("type") == "ADDED":
                name = event["object"]["metadata"]["name"]
                with self.changed:
                    self.seen.setdefault(name, time.perf_counter())
                    self.changed.notify_all()
                self.starting.put(name)

    def _node(self) -> None:
        """The stand-in node: each pod seen is reported Running at the stand-in master's
        address, as a kubelet would."""
        while True:
            name = self.starting.get()
            with contextlib.suppress(ApiError):  # gone already (a deleted job's)
                self.api.patch("v1/pods", name, self.running, NAMESPACE, subresource="status")

    def wait_all(self, names: list[str], timeout: float) -> tuple[float, float]:
        """When the first of `names` (a master) and the last were first seen; Refused as soon
        as a job failed."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not all(n in self.seen for n in names):
                self.jobs_seen.check()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [n for n in names if n not in self.seen]
                    raise TimeoutError(f"pods never appeared: {', '.join(missing[:5])} ...")
                self.changed.wait(min(left, 0.5))
            return self.seen[names[0]], max(self.seen[n] for n in names)

    def close(self) -> None:
        self.watch.close()
