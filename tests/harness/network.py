"""The pod network of the process-kubelet, built from Linux namespaces (needs root, as CI has).

- One private network namespace per kubelet, holding only loopback: its pods reach each other
  and nothing else, and their ports never clash with anything outside (other tests, other jobs
  on the machine, leftovers).
- An address per pod in 127.0.0.0/8, stable per pod name (so a re-created pod keeps it, as its
  DNS name would point to the new pod).
- DNS as /etc/hosts: each pod process runs in its own mount and UTS namespaces, with its
  hostname set and the kubelet's hosts file bind-mounted over /etc/hosts. Names are appended
  as pods start (never rewritten, so a reader never sees a half-written file); glibc rereads
  the file on every lookup.
- Like an operator pod on a cluster, a process can run in the pod network (`enter`) and still
  reach the API server: `forward` makes a port of the host's 127.0.0.1 reachable at the same
  port inside. Tests reach into the pod network with `get` (HTTP from a thread inside it)."""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

TOOLS = ("unshare", "nsenter", "setpriv", "mount", "hostname", "ip")

# Inside the pod's fresh mount+UTS namespaces: its /etc/hosts and hostname, then the container.
ENTER = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'

CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def unavailable() -> str | None:
    """Why pods cannot run here, or None."""
    if os.geteuid() != 0:
        return "the process-kubelet needs root (Linux namespaces and bind mounts)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    return f"the process-kubelet needs {', '.join(missing)}" if missing else None


class PodNetwork:
    def __init__(self, workdir: Path):
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.hosts = Path(workdir) / "hosts"
        self.hosts.write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n")
        self._lines: set[str] = set()
        self._forwards: list[_Forward] = []
        self._addresses: dict[tuple[str, str], str] = {}
        self._numbers = itertools.count(1)
        # The namespace lives as long as this holder process (killed with its parent, too).
        self._holder = subprocess.Popen(
            [
                "setpriv",
                "--pdeathsig",
                "KILL",
                "--",
                "unshare",
                "--net",
                "--",
                "sh",
                "-c",
                "ip link set lo up && echo up && exec sleep infinity",
            ],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert self._holder.stdout is not None
        if self._holder.stdout.readline().strip() != b"up":
            self.close()
            raise RuntimeError("could not create the pod network namespace")

    def address(self, namespace: str, pod: str) -> str:
        """The pod's address: 127.1.0.1, 127.1.0.2, ...; the same for the same pod name."""
        if (namespace, pod) not in self._addresses:
            n = next(self._numbers)
            while n % 256 in (0, 255):
                n = next(self._numbers)
            self._addresses[namespace, pod] = f"127.{1 + n // 65536}.{n // 256 % 256}.{n % 256}"
        return self._addresses[namespace, pod]

    def publish(self, address: str, names: list[str]) -> None:
        line = f"{address} {' '.join(names)}\n"
        if line not in self._lines:
            self._lines.add(line)
            with self.hosts.open("a") as f:
                f.write(line)

    def command(self, argv: list[str], hostname: str) -> list[str]:
        """`argv` as a pod's process: in the pod network, with its own hosts and hostname."""
        return [
            "setpriv",
            "--pdeathsig",
            "KILL",
            "--",  # dies with the kubelet, whatever happens
            "nsenter",
            f"--net=/proc/{self._holder.pid}/ns/net",
            "--",
            "unshare",
            "--mount",
            "--uts",
            "--",
            "sh",
            "-c",
            ENTER,
            "pod",
            str(self.hosts),
            hostname,
            *argv,
        ]

    def enter(self, argv: list[str]) -> list[str]:
        """`argv` run in the pod network only (no pod identity: e.g. the operator)."""
        return ["nsenter", f"--net=/proc/{self._holder.pid}/ns/net", "--", *argv]

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` in a thread inside the pod network (a network namespace is per thread)."""
        result: dict = {}

        def inside() -> None:
            try:
                with open(f"/proc/{self._holder.pid}/ns/net") as ns:
                    if _libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns into the pod network failed")
                result["value"] = fn()
            except BaseException as e:  # raised again in the caller
                result["error"] = e

        thread = threading.Thread(target=inside, name="in-pod-network", daemon=True)
        thread.start()
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    def get(self, url: str, timeout: float = 5.0) -> bytes:
        """GET `url` from inside the pod network (e.g. a pod's HTTP endpoint)."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def fetch() -> bytes:
            with opener.open(url, timeout=timeout) as response:
                return response.read()

        return self.call(fetch)

    def forward(self, port: int) -> None:
        """Make the host's 127.0.0.1:`port` (e.g. the API server) reachable at 127.0.0.1:`port`
        inside the pod network."""
        listener = self.call(lambda: socket.create_server(("127.0.0.1", port)))
        self._forwards.append(_Forward(listener, ("127.0.0.1", port)))

    def close(self) -> None:
        for forward in self._forwards:
            forward.close()
        if self._holder.poll() is None:
            self._holder.kill()
        self._holder.wait(5)


_libc = ctypes.CDLL(None, use_errno=True)


class _Forward:
    """Accepts on a listening socket (of the pod network) and pipes each connection to
    `target` (connected from the host network), both ways, until either side closes."""

    def __init__(self, listener: socket.socket, target: tuple[str, int]):
        self.listener = listener
        self.target = target
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="forward", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inner, _ = self.listener.accept()
            except OSError:  # closed
                return
            try:
                outer = socket.create_connection(self.target, timeout=5)
                outer.settimeout(None)
            except OSError:
                inner.close()
                continue
            with self._lock:
                self._open |= {inner, outer}
            for src, dst in ((inner, outer), (outer, inner)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):  # one side is done: so is the connection
            with self._lock:
                self._open.discard(sock)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone may not)
        except OSError:
            pass
        self.listener.close()
        with self._lock:
            socks, self._open = list(self._open), set()
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
