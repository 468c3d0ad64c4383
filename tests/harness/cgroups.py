"""Memory limits that bite, for local processes: one cgroup (v1 memory controller) per
process, as a pod's `resources.limits.memory` gives each container its own.

A process over its limit is killed by the kernel's OOM killer (SIGKILL), exactly as a
container over its limit is on a node. The cgroups are made under the test's own cgroup, so
they stay inside whatever limits the machine set for it, and they are removed on leaving.
Root and a writable v1 memory hierarchy are needed (`available` says why not)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")


def own_cgroup() -> Path:
    """This process's cgroup in the v1 memory hierarchy."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return ROOT / path.lstrip("/")
    raise LookupError("this process is in no cgroup of a v1 memory hierarchy")


def available() -> str | None:
    """None when per-process memory limits can be set here, else why not."""
    if not (ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {ROOT}"
    try:
        parent = own_cgroup()
    except LookupError as e:
        return str(e)
    if not os.access(parent, os.W_OK):
        return f"{parent} is not writable (memory limits need root)"
    return None


class MemoryLimits:
    """`place(name, pid)` puts a running process under a limit of `limit` bytes in a cgroup of
    its own (its children inherit it). The limit counts what the process allocates from then
    on (recent kernels no longer move earlier charges): place it before it allocates much."""

    def __init__(self, limit: int):
        self.limit = limit
        self.parent = own_cgroup() / f"pipejob-test-{uuid.uuid4().hex[:8]}"
        self.parent.mkdir()
        self.groups: dict[str, Path] = {}

    def place(self, name: str, pid: int) -> None:
        group = self.parent / name
        group.mkdir()
        self.groups[name] = group
        (group / "memory.limit_in_bytes").write_text(str(self.limit))
        (group / "cgroup.procs").write_text(str(pid))

    def peak(self, name: str) -> int:
        """The most memory `name`'s cgroup ever counted, in bytes."""
        return int((self.groups[name] / "memory.max_usage_in_bytes").read_text())

    def oom_kills(self, name: str) -> int:
        """Processes of `name`'s cgroup the OOM killer ended for going over the limit."""
        for line in (self.groups[name] / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def describe(self) -> str:
        """Each cgroup's peak usage and OOM kills, for a failure's message."""
        return "; ".join(
            f"{name}: peak {self.peak(name) / 1e6:.0f} MB of"
            f" {self.limit / 1e6:.0f}, OOM kills {self.oom_kills(name)}"
            for name in self.groups
        )

    def close(self, timeout: float = 30.0) -> None:
        """Remove the cgroups once their processes are gone (a cgroup with a process in it
        cannot be removed: wait for them, up to `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        for group in [*self.groups.values(), self.parent]:
            while True:
                try:
                    group.rmdir()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

    def __enter__(self) -> MemoryLimits:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
