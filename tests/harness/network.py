"""The pod network of the process-kubelet, built from Linux namespaces (needs root, as CI has).

- One private network namespace per kubelet, holding only loopback: its pods reach each other
  and nothing else, and their ports never clash with anything outside (other tests, other jobs
  on the machine, leftovers).
- An address per pod in 127.0.0.0/8, stable per pod name (so a re-created pod keeps it, as its
  DNS name would point to the new pod).
- DNS as /etc/hosts: each pod process runs in its own mount and UTS namespaces, with its
  hostname set and the kubelet's hosts file bind-mounted over /etc/hosts. Names are appended
  as pods start (never rewritten, so a reader never sees a half-written file); glibc rereads
  the file on every lookup."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path

TOOLS = ("unshare", "nsenter", "setpriv", "mount", "hostname", "ip")

# Inside the pod's fresh mount+UTS namespaces: its /etc/hosts and hostname, then the container.
ENTER = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


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
        self._addresses: dict[tuple[str, str], str] = {}
        self._numbers = itertools.count(1)
        # The namespace lives as long as this holder process (killed with its parent, too).
        self._holder = subprocess.Popen(
            ["setpriv", "--pdeathsig", "KILL", "--", "unshare", "--net", "--",
             "sh", "-c", "ip link set lo up && echo up && exec sleep infinity"],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
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
            "setpriv", "--pdeathsig", "KILL", "--",  # dies with the kubelet, whatever happens
            "nsenter", f"--net=/proc/{self._holder.pid}/ns/net", "--",
            "unshare", "--mount", "--uts", "--",
            "sh", "-c", ENTER, "pod", str(self.hosts), hostname, *argv,
        ]  # fmt: skip

    def close(self) -> None:
        if self._holder.poll() is None:
            self._holder.kill()
        self._holder.wait(5)
