"""Join the RPC world (and, for a group's members, their collective process group).

Workers may start long before the master is reachable (a pod's DNS name appears only once
the pod exists), so rendezvous is retried until a deadline, with a message that names the
address and port it is waiting for. Both rendezvous go through `pipejob://`: torch's tcp://
store, whose server listens on the rendezvous address alone where that is a loopback one
(torch's listens on every interface)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlparse

from pipejob.trainer.runtime import failures, tuning
from pipejob.trainer.runtime.world import Env, RendezvousError, listen_address, log

SCHEME = "pipejob"

# The RPC timeout for ordinary calls once the world has formed.
RPC_TIMEOUT_SECONDS = 300.0


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


def store(
    host: str,
    port: int,
    world_size: int | None,
    server: bool,
    timeout: timedelta,
    wait_for_workers: bool = True,
) -> Any:
    """A TCPStore at host:port; the `server`'s listens where world.listen_address says."""
    from torch.distributed import TCPStore

    listening = None
    if server:
        listening = socket.create_server((listen_address(host), port), backlog=1024).detach()
    return TCPStore(
        host, port, world_size, server, timeout, wait_for_workers, master_listen_fd=listening
    )


def _rendezvous(
    url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any
) -> Iterator[tuple[Any, int, int]]:
    """torch.distributed's rendezvous handler for `pipejob://HOST:PORT?rank=R&world_size=N`:
    rank 0 serves the store."""
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    rank, world_size = int(query["rank"]), int(query["world_size"])
    yield (
        store(parsed.hostname or "", parsed.port or 0, world_size, rank == 0, timeout),
        rank,
        world_size,
    )
    raise RuntimeError(f"{SCHEME}:// cannot rendezvous again: a world that broke restarts whole")


def _register() -> None:
    import torch.distributed as dist

    try:
        dist.register_rendezvous_handler(SCHEME, _rendezvous)
    except RuntimeError:  # registered by an earlier join in this process
        pass


def backend_options(
    env: Env,
    timeout: float,
    device_maps: dict[str, dict[int, int]] | None = None,
    devices: list[int] | None = None,
):
    import torch.distributed.rpc as rpc

    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=16,
        rpc_timeout=timeout,
        init_method=f"{SCHEME}://{env.master_addr}:{env.master_port}",
        **tuning.rpc_backend_kwargs(env.kind, env.role, env.rank, env.roles, env.gpus),
    )
    for peer, mapping in (device_maps or {}).items():
        options.set_device_map(peer, mapping)
    if devices:
        options.set_devices(devices)
    return options


def join_rpc(
    env: Env, device_maps: dict[str, dict[int, int]] | None = None, devices: list[int] | None = None
) -> None:
    """init_rpc with a rendezvous deadline; afterwards calls use RPC_TIMEOUT_SECONDS."""
    import torch.distributed.rpc as rpc

    require_rpc()
    _register()
    deadline = time.monotonic() + env.rendezvous_timeout
    if env.rank != 0:
        wait_reachable(env.master_addr, env.master_port, deadline, "the master's rendezvous", env)
    # During init the store timeout is the RPC timeout: give the whole world the time left.
    left = max(1.0, deadline - time.monotonic())
    failures.say_remote_errors_in_one_line()
    try:
        rpc.init_rpc(
            env.rpc_name,
            rank=env.rank,
            world_size=env.world_size,
            rpc_backend_options=backend_options(env, left, device_maps, devices),
        )
    except (RuntimeError, OSError) as e:  # OSError: the master cannot listen on its port
        raise RendezvousError(
            f"the RPC world ({env.world_size} processes: {', '.join(env.world)}) did not form"
            f" within {env.rendezvous_timeout:g}s via {env.master_addr}:{env.master_port}: {e}"
        ) from None
    rpc._set_rpc_timeout(RPC_TIMEOUT_SECONDS)


def join_ddp(env: Env) -> None:
    """This process's collective group (a HybridJob's trainers' DDP, stage i of every
    replica of a PipelineJob): its own rendezvous port, never the RPC one."""
    import torch.distributed as dist

    assert env.ddp_addr and env.ddp_port is not None
    _register()
    deadline = time.monotonic() + env.rendezvous_timeout
    if env.ddp_rank != 0:
        what = f"the {env.ddp_group} group's rendezvous (its rank 0)"
        wait_reachable(env.ddp_addr, env.ddp_port, deadline, what, env)
    left = max(1.0, deadline - time.monotonic())
    dist.init_process_group(
        backend=env.ddp_backend,
        init_method=f"{SCHEME}://{env.ddp_addr}:{env.ddp_port}",
        rank=env.ddp_rank,
        world_size=env.ddp_world_size,
        timeout=timedelta(seconds=left),
    )
