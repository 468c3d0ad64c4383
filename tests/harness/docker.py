"""Docker for the container tests: is a daemon there, the product's images built from the
checkout (once per test run, by `scripts/images.sh`, the script behind `make images`), and a
bridge network of the test's own.

The images are built with test tags, so a developer's `make images` tags are left alone; the
layer cache makes the build after the first one a matter of seconds."""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import random
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# PIPEJOB_TEST_TAG names the tags' version, so checkouts testing side by side on one daemon
# keep their images apart.
_VERSION = os.environ.get("PIPEJOB_TEST_TAG", "test")
OPERATOR_TAG = f"pipejob/operator:{_VERSION}"
TRAINER_TAG = f"pipejob/trainer:{_VERSION}"
LABEL = "dev.pipejob.test"  # on every network and container the tests make


@functools.cache
def unavailable() -> str | None:
    """Why containers cannot run here, or None (asked once per test run)."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    try:
        subprocess.run(["docker", "info"], capture_output=True, timeout=20, check=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return "no docker daemon answers (.ci/run starts one when run as root)"
    return None


def cli(*args: str, timeout: float = 120, check: bool = True) -> str:
    """Run `docker ARGS`; its stdout. A failure raises with docker's own message."""
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} ... failed: {done.stderr.strip()}")
    return done.stdout


def inspect(name: str, kind: str = "container") -> dict | None:
    out = cli(kind, "inspect", name, check=False)
    found = json.loads(out) if out.strip() else []
    return found[0] if found else None


@dataclass(frozen=True)
class Images:
    operator: str
    trainer: str
    build_seconds: float

    def size_mb(self, tag: str) -> int:
        return int(inspect(tag, "image")["Size"]) // 1_000_000


def build_images() -> Images:
    """Both targets of the Dockerfile, built from the checkout as `make images` builds them."""
    start = time.monotonic()
    done = subprocess.run(
        [str(ROOT / "scripts" / "images.sh"), OPERATOR_TAG, TRAINER_TAG],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"scripts/images.sh failed:\n{done.stdout}\n{done.stderr}")
    return Images(OPERATOR_TAG, TRAINER_TAG, time.monotonic() - start)


class Network:
    """A user-defined bridge network of the test's own: its subnet, its gateway (the host's
    address on it) and an address per pod. Internal: its containers reach each other and the
    host's address on it, nothing outside (no NAT). Removed, with whatever is left on it, on
    close."""

    def __init__(self) -> None:
        self.name = f"pipejob-test-{uuid.uuid4().hex[:8]}"
        # A subnet of its own (docker assigns a pod's fixed address only in one it was given):
        # a free /24 of 10.213.0.0/16, as docker says when one is taken.
        for third in random.sample(range(256), 32):
            self.subnet = ipaddress.ip_network(f"10.213.{third}.0/24")
            self.gateway = str(self.subnet.network_address + 1)
            done = subprocess.run(
                [
                    "docker",
                    "network",
                    "create",
                    "--driver",
                    "bridge",
                    "--internal",
                    "--subnet",
                    str(self.subnet),
                    "--gateway",
                    self.gateway,
                    "--label",
                    LABEL,
                    self.name,
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if done.returncode == 0:
                break
            if "overlap" not in done.stderr:
                raise RuntimeError(f"docker network create failed: {done.stderr.strip()}")
        else:
            raise RuntimeError("no free /24 in 10.213.0.0/16 for a docker network")
        self._hosts = (str(h) for h in self.subnet.hosts() if str(h) != self.gateway)
        self._addresses: dict[tuple[str, str], str] = {}

    def address(self, namespace: str, pod: str) -> str:
        """The pod's address, the same for the same pod name (as its DNS name would be)."""
        if (namespace, pod) not in self._addresses:
            self._addresses[namespace, pod] = next(self._hosts)
        return self._addresses[namespace, pod]

    def close(self) -> None:
        left = cli("ps", "-aq", "--filter", f"network={self.name}", check=False).split()
        if left:
            cli("rm", "-f", *left, check=False)
        cli("network", "rm", self.name, check=False)
