"""Read the env contract and join the RPC world (and, for trainers, the DDP group).

Workers may start long before the master is reachable (a pod's DNS name appears only once
the pod exists), so rendezvous is retried until a deadline, with a message that names the
address and port it is waiting for."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pipejob.core import contract as c
from pipejob.trainer import tuning

# The RPC timeout for ordinary calls once the world has formed.
RPC_TIMEOUT_SECONDS = 300.0


class ContractError(RuntimeError):
    """The environment does not hold what the world plan promises."""


class RendezvousError(RuntimeError):
    """A rendezvous endpoint stayed unreachable until the deadline."""


class PreflightError(RuntimeError):
    """The world failed its communication check; the message starts with "preflight:" (the
    operator's cue for the Preflight condition)."""

    def __init__(self, message: str):
        super().__init__(message if message.startswith("preflight:") else f"preflight: {message}")


@dataclass(frozen=True)
class Env:
    kind: str
    job: str
    role: str
    role_index: int
    rpc_name: str
    rank: int
    world_size: int
    world: tuple[str, ...]  # RPC names in rank order
    master_addr: str
    master_port: int
    addresses: tuple[str, ...]  # where each rank is reached, in rank order (for messages)
    preflight_port: int
    monitor_port: int
    spec: dict[str, Any]
    gpus: int
    rendezvous_timeout: float
    ddp_addr: str | None = None
    ddp_port: int | None = None
    ddp_rank: int | None = None
    ddp_world_size: int | None = None
    ddp_backend: str | None = None
    summary_file: str | None = None

    def names(self, role: str) -> list[str]:
        """RPC names of the world's members with this role, in rank order."""
        return [n for n in self.world if n.rstrip("0123456789") == role]


def _get(environ: dict[str, str], name: str) -> str:
    value = environ.get(name)
    if value is None or value == "":
        raise ContractError(f"environment variable {name} is not set ({c.DOCS[name]})")
    return value


def _int(environ: dict[str, str], name: str) -> int:
    value = _get(environ, name)
    try:
        return int(value)
    except ValueError:
        raise ContractError(f"{name} must be an integer, got {value!r}") from None


def read_env(environ: dict[str, str] | None = None) -> Env:
    environ = dict(os.environ if environ is None else environ)
    try:
        spec = json.loads(_get(environ, c.SPEC))
    except json.JSONDecodeError as e:
        raise ContractError(f"environment variable {c.SPEC} is not valid JSON: {e}") from None
    role = _get(environ, c.ROLE)
    ddp: dict[str, Any] = {}
    if role == "trainer":
        ddp = {
            "ddp_addr": _get(environ, c.DDP_ADDR),
            "ddp_port": _int(environ, c.DDP_PORT),
            "ddp_rank": _int(environ, c.DDP_RANK),
            "ddp_world_size": _int(environ, c.DDP_WORLD_SIZE),
            "ddp_backend": _get(environ, c.DDP_BACKEND),
        }
    env = Env(
        kind=_get(environ, c.KIND),
        job=_get(environ, c.JOB),
        role=role,
        role_index=_int(environ, c.ROLE_INDEX),
        rpc_name=_get(environ, c.RPC_NAME),
        rank=_int(environ, c.RANK),
        world_size=_int(environ, c.WORLD_SIZE),
        world=tuple(_get(environ, c.WORLD).split(",")),
        master_addr=_get(environ, c.MASTER_ADDR),
        master_port=_int(environ, c.MASTER_PORT),
        addresses=tuple(_get(environ, c.ADDRESSES).split(",")),
        preflight_port=_int(environ, c.PREFLIGHT_PORT),
        monitor_port=_int(environ, c.MONITOR_PORT),
        spec=spec,
        gpus=_int(environ, c.GPUS),
        rendezvous_timeout=float(_int(environ, c.RENDEZVOUS_TIMEOUT)),
        summary_file=environ.get(c.SUMMARY_FILE) or None,
        **ddp,
    )
    if len(env.world) != env.world_size or env.world[env.rank] != env.rpc_name:
        raise ContractError(
            f"{c.WORLD}={','.join(env.world)} does not agree with "
            f"{c.WORLD_SIZE}={env.world_size}, {c.RANK}={env.rank}, {c.RPC_NAME}={env.rpc_name}"
        )
    if len(env.addresses) != env.world_size:
        raise ContractError(
            f"{c.ADDRESSES} names {len(env.addresses)} addresses for a world of {env.world_size}"
        )
    return env


def describe(env: Env, rank: int) -> str:
    """A peer as messages name it: "rank 2 (stage1, role stage, address 10.0.0.7)"."""
    name = env.world[rank]
    return f"rank {rank} ({name}, role {name.rstrip('0123456789')}, address {env.addresses[rank]})"


# Kubernetes shows this file's content as the container's termination message.
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LOG_ENV = c.TERMINATION_LOG  # overrides the path (e.g. in tests)


def write_termination_message(message: str) -> None:
    """The one-line reason a process failed, where Kubernetes (or a test) looks for it. The
    default file counts only if it exists: outside a pod there is nothing to write."""
    path = os.environ.get(TERMINATION_LOG_ENV) or TERMINATION_LOG
    if path == TERMINATION_LOG and not os.path.exists(path):
        return
    try:
        with open(path, "w") as f:
            f.write(" ".join(message.split())[:4000] + "\n")
    except OSError as e:
        log(None, f"could not write the termination message to {path}: {e}")


def log(env: Env | None, message: str) -> None:
    """One line of output. No name prefix: a pod's log is its own, and the local runner
    prefixes each line with the process's RPC name."""
    print(message, file=sys.stderr if env is None else sys.stdout, flush=True)


def wait_reachable(host: str, port: int, deadline: float, what: str, env: Env) -> None:
    """Block until host:port accepts TCP connections, or raise RendezvousError at deadline.

    DNS is retried too: a pod's name resolves only once the pod exists."""
    delay, last_error, announced = 0.1, "", False
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as e:
            last_error = f"{type(e).__name__}: {e}"
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(
                f"could not reach {what} at {host}:{port} within the rendezvous timeout"
                f" ({env.rendezvous_timeout:g}s; last error: {last_error})"
            )
        if not announced:
            log(env, f"waiting for {what} at {host}:{port} ({last_error}); retrying")
            announced = True
        time.sleep(min(delay, left))
        delay = min(delay * 2, 2.0)


def require_rpc() -> None:
    import torch.distributed.rpc as rpc

    if not rpc.is_available():
        raise RuntimeError(
            "torch.distributed.rpc is not available in this torch build; pipejob needs a torch"
            " built with distributed support (pip install torch==2.13.0)"
        )


def backend_options(env: Env, timeout: float, device_maps: dict[str, dict[int, int]] | None = None,
                    devices: list[int] | None = None):  # fmt: skip
    import torch.distributed.rpc as rpc

    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=16,
        rpc_timeout=timeout,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        **tuning.rpc_backend_kwargs(env.kind, env.role, env.gpus),  # busy-polling where it pays
    )
    for peer, mapping in (device_maps or {}).items():
        options.set_device_map(peer, mapping)
    if devices:
        options.set_devices(devices)
    return options


def join_rpc(env: Env, device_maps: dict[str, dict[int, int]] | None = None,
             devices: list[int] | None = None) -> None:  # fmt: skip
    """init_rpc with a rendezvous deadline; afterwards calls use RPC_TIMEOUT_SECONDS."""
    import torch.distributed.rpc as rpc

    require_rpc()
    deadline = time.monotonic() + env.rendezvous_timeout
    if env.rank != 0:
        wait_reachable(env.master_addr, env.master_port, deadline, "the master's rendezvous", env)
    # During init the store timeout is the RPC timeout: give the whole world the time left.
    left = max(1.0, deadline - time.monotonic())
    try:
        rpc.init_rpc(
            env.rpc_name,
            rank=env.rank,
            world_size=env.world_size,
            rpc_backend_options=backend_options(env, left, device_maps, devices),
        )
    except RuntimeError as e:
        raise RendezvousError(
            f"the RPC world ({env.world_size} processes: {', '.join(env.world)}) did not form"
            f" within {env.rendezvous_timeout:g}s via {env.master_addr}:{env.master_port}: {e}"
        ) from None
    rpc._set_rpc_timeout(RPC_TIMEOUT_SECONDS)


def join_ddp(env: Env) -> None:
    """The trainers' own process group: its own rendezvous port, never the RPC one."""
    import torch.distributed as dist

    assert env.ddp_addr and env.ddp_port is not None
    deadline = time.monotonic() + env.rendezvous_timeout
    if env.ddp_rank != 0:
        wait_reachable(env.ddp_addr, env.ddp_port, deadline, "the DDP rendezvous (trainer0)", env)
    left = max(1.0, deadline - time.monotonic())
    dist.init_process_group(
        backend=env.ddp_backend,
        init_method=f"tcp://{env.ddp_addr}:{env.ddp_port}",
        rank=env.ddp_rank,
        world_size=env.ddp_world_size,
        timeout=timedelta(seconds=left),
    )
