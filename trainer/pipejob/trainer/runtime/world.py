"""This process's place in the world, read from the env contract, and how it speaks: its log
lines and, when it fails, its termination message."""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass
from typing import Generic, TypedDict, TypeVar

from pipejob.core import contract as c
from pipejob.core import master_first
from pipejob.core.common_spec import CommonSpec, from_spec
from pipejob.core.kind import Kind
from pipejob.core.kinds import KINDS


class ContractError(RuntimeError):
    """The environment does not hold what the world plan promises."""


class RendezvousError(RuntimeError):
    """A rendezvous endpoint stayed unreachable until the deadline."""


class PreflightError(RuntimeError):
    """The world failed its communication check; the message starts with "preflight:" (the
    operator's cue for the Preflight condition)."""

    def __init__(self, message: str):
        prefix = c.PREFLIGHT_PREFIX
        super().__init__(message if message.startswith(prefix) else f"{prefix} {message}")


def loopback(address: str) -> bool:
    """Whether a member's address is this machine's loopback (`pipejob run`'s worlds)."""
    return address == "localhost" or address.startswith("127.")


def listen_address(address: str) -> str:
    """Where a world member reachable at `address` listens: on that address alone where it
    is a loopback one (`pipejob run`: nothing off this machine reaches a world whose members
    unpickle what they receive), on every interface in a pod (its NetworkPolicy admits only
    its world)."""
    return address if loopback(address) else "0.0.0.0"


S = TypeVar("S", bound=CommonSpec)  # the kind's typed spec (core/kinds/)


@dataclass(frozen=True)
class Env(Generic[S]):
    """This process's place in the world, as the env contract gives it: `Env[PipelineSpec]`
    in a PipelineJob's processes, `Env[HybridSpec]` in a HybridJob's."""

    kind: str
    job: str
    role: str
    role_index: int
    replica: int  # PipelineJob: this process's copy of the pipeline
    rpc_name: str
    rank: int
    world_size: int
    world: tuple[str, ...]  # RPC names in rank order
    roles: tuple[str, ...]  # roles in rank order
    groups: dict[str, tuple[int, ...]]  # collective groups: world ranks in group rank order
    master_addr: str
    master_port: int
    addresses: tuple[str, ...]  # where each rank is reached, in rank order (for messages)
    preflight_port: int
    monitor_port: int
    spec: S
    gpus: int
    rendezvous_timeout: float
    ddp_group: str | None = None  # the collective group this process is a member of
    ddp_addr: str | None = None
    ddp_port: int | None = None
    ddp_rank: int | None = None
    ddp_world_size: int | None = None
    ddp_backend: str | None = None
    summary_file: str | None = None
    master_first: bool = False  # the others start once the master checked (MASTER_FIRST)
    # ... as pods the operator creates then (MASTER_FIRST=pods): scheduled, pulling images
    others_as_pods: bool = False

    @property
    def definition(self) -> Kind:
        return KINDS[self.kind]

    def others_after(self, own_start: float) -> float:
        """Seconds after a master started first (MASTER_FIRST) that the others may arrive: about
        as long as its own start took, and rendezvousTimeoutSeconds more where their pods are
        made only once it has checked (scheduling, image pulls)."""
        return own_start + (self.rendezvous_timeout if self.others_as_pods else 0.0)

    def names(self, role: str) -> list[str]:
        """RPC names of the world's members with this role, in rank order."""
        return [n for n, r in zip(self.world, self.roles, strict=True) if r == role]


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


def _groups(text: str) -> dict[str, tuple[int, ...]]:
    try:
        return {
            name: tuple(int(r) for r in ranks.split(","))
            for name, _, ranks in (g.partition("=") for g in text.split(";") if g)
        }
    except ValueError:
        raise ContractError(f"{c.GROUPS}={text!r} is not name=rank,...;...") from None


def read_env(environ: dict[str, str] | None = None) -> Env[CommonSpec]:
    """This process's env, read from `environ` (the process's own by default) and checked."""
    environ = dict(os.environ if environ is None else environ)
    kind = _get(environ, c.KIND)
    if kind not in KINDS:
        raise ContractError(f"{c.KIND}={kind!r} is not a job kind ({', '.join(KINDS)})")
    try:
        spec: CommonSpec = from_spec(KINDS[kind].settings, json.loads(_get(environ, c.SPEC)))
    except (json.JSONDecodeError, TypeError) as e:
        raise ContractError(f"environment variable {c.SPEC} is not the job's spec: {e}") from None
    env = Env(
        kind=kind,
        job=_get(environ, c.JOB),
        role=_get(environ, c.ROLE),
        role_index=_int(environ, c.ROLE_INDEX),
        replica=_int(environ, c.REPLICA),
        rpc_name=_get(environ, c.RPC_NAME),
        rank=_int(environ, c.RANK),
        world_size=_int(environ, c.WORLD_SIZE),
        world=tuple(_get(environ, c.WORLD).split(",")),
        roles=tuple(_get(environ, c.ROLES).split(",")),
        groups=_groups(environ.get(c.GROUPS, "")),
        master_addr=_get(environ, c.MASTER_ADDR),
        master_port=_int(environ, c.MASTER_PORT),
        addresses=tuple(_get(environ, c.ADDRESSES).split(",")),
        preflight_port=_int(environ, c.PREFLIGHT_PORT),
        monitor_port=_int(environ, c.MONITOR_PORT),
        spec=spec,
        gpus=_int(environ, c.GPUS),
        rendezvous_timeout=float(_int(environ, c.RENDEZVOUS_TIMEOUT)),
        summary_file=environ.get(c.SUMMARY_FILE) or None,
        master_first=environ.get(c.MASTER_FIRST) in master_first.VALUES,
        others_as_pods=environ.get(c.MASTER_FIRST) == master_first.PODS,
        **_ddp(environ),
    )
    _check_world(env)
    return env


class DdpFields(TypedDict, total=False):
    """`Env`'s collective-group fields, where the plan seated the process in a group."""

    ddp_group: str
    ddp_addr: str
    ddp_port: int
    ddp_rank: int
    ddp_world_size: int
    ddp_backend: str


def _ddp(environ: dict[str, str]) -> DdpFields:
    """The collective group's fields, where the plan seated this process in one."""
    if not environ.get(c.DDP_GROUP):
        return {}
    return DdpFields(
        ddp_group=_get(environ, c.DDP_GROUP),
        ddp_addr=_get(environ, c.DDP_ADDR),
        ddp_port=_int(environ, c.DDP_PORT),
        ddp_rank=_int(environ, c.DDP_RANK),
        ddp_world_size=_int(environ, c.DDP_WORLD_SIZE),
        ddp_backend=_get(environ, c.DDP_BACKEND),
    )


def _check_world(env: Env[CommonSpec]) -> None:
    """The world's names, roles and addresses agree with this process's rank and size."""
    if (
        len(env.world) != env.world_size
        or env.world[env.rank] != env.rpc_name
        or len(env.roles) != env.world_size
        or env.roles[env.rank] != env.role
    ):
        raise ContractError(
            f"{c.WORLD}={','.join(env.world)} and {c.ROLES}={','.join(env.roles)} do not agree"
            f" with {c.WORLD_SIZE}={env.world_size}, {c.RANK}={env.rank},"
            f" {c.RPC_NAME}={env.rpc_name}, {c.ROLE}={env.role}"
        )
    if len(env.addresses) != env.world_size:
        raise ContractError(
            f"{c.ADDRESSES} names {len(env.addresses)} addresses for a world of {env.world_size}"
        )


@functools.cache
def current() -> Env[CommonSpec]:
    """This process's env, read once: for the functions other processes call over RPC."""
    return read_env()


def describe(env: Env, rank: int) -> str:
    """A peer as messages name it: "rank 2 (stage1, role stage, address 10.0.0.7)"."""
    return f"rank {rank} ({env.world[rank]}, role {env.roles[rank]}, address {env.addresses[rank]})"


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
