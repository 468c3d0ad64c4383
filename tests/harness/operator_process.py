"""The unmodified operator, `pipejob operator`, as a process pointed at the emulator."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from harness.network import PodNetwork

PIPEJOB = Path(sys.executable).parent / "pipejob"


class OperatorProcess:
    """Start, stop or kill -9 the operator; `logs()` is what it printed (all its runs).

    With a `network`, it runs in the pod network (as its pod would on a cluster: it reaches
    the pods' addresses, e.g. a master's /progress); the API server must be forwarded into it
    (PodNetwork.forward), and its endpoints are reached with `get`."""

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        log: Path,
        resync_seconds: float = 2.0,
        network: PodNetwork | None = None,
        progress_seconds: float = 1.0,
        args: tuple[str, ...] = (),
    ):
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.log = Path(log)
        self.resync_seconds = resync_seconds
        self.progress_seconds = progress_seconds
        self.network = network
        self.args = args  # more `pipejob operator` flags
        self.process: subprocess.Popen | None = None
        self.metrics_url = ""

    def start(self, timeout: float = 30.0) -> OperatorProcess:
        port, metrics_port = _free_port(), _free_port()  # liveness and metrics endpoints
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PIPEJOB_RESYNC_SECONDS": str(self.resync_seconds),
            "PIPEJOB_PROGRESS_SECONDS": str(self.progress_seconds),
        }
        # Dies with the tests, even when they are killed: no operator outlives its cluster.
        guard = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
        argv = [
            str(PIPEJOB),
            "operator",
            "-n",
            self.namespace,
            "--log-level",
            "debug",
            "--health-host",
            "127.0.0.1",
            "--health-port",
            str(port),
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(metrics_port),
            *self.args,
        ]
        argv = [*guard, *(self.network.enter(argv) if self.network else argv)]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        atexit.register(self.kill)
        deadline = time.monotonic() + timeout
        while not self._healthy(port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the operator did not come up:\n{self.logs()[-3000:]}")
            time.sleep(0.2)
        return self

    def _healthy(self, port: int) -> bool:
        try:
            self.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return True
        except OSError:
            return False

    def get(self, url: str, timeout: float = 5.0) -> bytes:
        """GET one of the operator's endpoints (from its network)."""
        if self.network is not None:
            return self.network.get(url, timeout)
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read()

    def kill(self) -> None:
        """kill -9: no cleanup, no goodbye, as when its pod is lost."""
        self._signal(signal.SIGKILL)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM), or kill it after `timeout`."""
        self._signal(signal.SIGTERM, timeout)

    def _signal(self, sig: int, timeout: float = 5.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, sig)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
