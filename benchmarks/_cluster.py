"""The emulated cluster as the operator benchmarks drive it (operator_scale.py, chaos.py): the
tests' API server without kmock's request log, counting the operator's requests, and the
unmodified operator (`pipejob operator`) as a process against it, with its memory and CPU
read from /proc."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from _common import REPO, free_port

sys.path.insert(0, str(REPO / "tests"))
from harness.apiserver import ApiServer  # the tests' harness lives in tests/

NAMESPACE = "default"
PR_SET_NAME = 15  # prctl: the calling thread's name, as /proc/<pid>/task/<tid>/stat shows it
PIPEJOB = Path(sys.executable).parent / "pipejob"


class LeanApiServer(ApiServer):
    """The harness's API server without kmock's request log, and with its store indexed.
    kmock keeps every request for test assertions and matches each new one against all of
    them (its `_handle` walks the log), and the harness walks every object of every kind for
    a LIST without a label pinned: the emulator's cost per request grew with the requests
    served and the objects kept, so at a few thousand jobs the emulator, not the operator,
    set the pace. A real API server's store is keyed by resource and namespace; here the live
    objects' keys are kept by resource (the harness's server keeps them by label, for the
    operator's LISTs of one job's pods, and by owner, for its garbage collector). It counts
    the operator's requests (by User-Agent, as the harness's faults tell it), and names its
    thread `apiserver` for the kernel, so a benchmark reads its CPU apart from the others'
    (_common.counters)."""

    operator_requests = 0
    by_call: Counter = Counter()  # the operator's requests by what they do: "LIST pods"

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.request_log = False
        self._by_resource: dict = defaultdict(dict)  # resource -> {key of a live object: None}
        with contextlib.suppress(OSError, AttributeError):  # made in the server's own thread
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, b"apiserver", 0, 0, 0)

    async def _publish(self, key, kind: str, obj: dict) -> dict:
        obj = await super()._publish(key, kind, obj)
        if kind == "DELETED":
            self._by_resource[key[0]].pop(key, None)
        else:
            self._by_resource[key[0]][key] = None
        return obj

    def _live_items(self, res, namespace: str | None) -> list[dict]:
        return [
            self._objects[key].raw
            for key in self._by_resource[res]
            if namespace is None or key[1] == namespace
        ]

    async def __call__(self, raw):
        if any(agent in raw.headers.get("User-Agent", "") for agent in self.faults.agents):
            LeanApiServer.operator_requests += 1
            LeanApiServer.by_call[call_name(raw.method, raw.path, raw.query)] += 1
        return await super().__call__(raw)


def call_name(method: str, path: str, query) -> str:
    """What a request does, as "GET pipelinejobs", "LIST pods", "WATCH pods",
    "PATCH pipelinejobs/status": the verb and the resource, without names."""
    parts = path.strip("/").split("/")
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    resource, named = rest[0] if rest else "?", len(rest) > 1
    if len(rest) > 2:
        resource += "/" + rest[2]
    verb = method
    if method == "GET" and not named:
        verb = "WATCH" if query.get("watch") in ("true", "1") else "LIST"
    return f"{verb} {resource}"


class Operator:
    """`pipejob operator` as a process against the emulator, with production-like settings."""

    def __init__(self, kubeconfig: Path, log: Path, log_level: str, resync: float):
        self.port = free_port()
        argv = [
            str(PIPEJOB),
            "operator",
            "-n",
            NAMESPACE,
            "--log-level",
            log_level,
            "--health-host",
            "127.0.0.1",
            "--health-port",
            str(self.port),
        ]
        argv += ["--metrics-host", "127.0.0.1", "--metrics-port", str(free_port())]
        guard = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
        env = os.environ | {"KUBECONFIG": str(kubeconfig), "PIPEJOB_RESYNC_SECONDS": str(resync)}
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [*guard, *argv],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_healthy(self, timeout: float = 60) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "the operator did not come up:\n" + self.log.read_text()[-3000:]
                    ) from None
                time.sleep(0.2)

    def memory(self) -> tuple[float, float]:
        """(VmRSS, VmHWM) in MB."""
        fields = {}
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
        return fields["VmRSS"], fields["VmHWM"]

    def cpu_seconds(self) -> float:
        f = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        """SIGKILL, as a node's OOM killer or a lost node would end it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
