"""The world plan: one pure function from a validated job to its processes.

The operator renders the plan as Pods, the local runner as processes; neither rebuilds it.
Roles and groups come from the job's kind (core/kinds/), as data: nothing is parsed back
out of a name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipejob.core import contract as c
from pipejob.core.spec import Job

# Each process runs the trainer; the renderer supplies the interpreter.
TRAINER_MODULE = ("-m", "pipejob.trainer")


@dataclass(frozen=True)
class Ports:
    rpc: int = 29500  # the RPC world's rendezvous on the master
    ddp: int = 29501  # a kind's collective group (HybridJob's DDP), on the group's rank 0
    preflight: int = 29502  # the whole world's gloo group for the preflight check, on the master
    monitor: int = 29503  # the master's HTTP endpoint: /progress (JSON) and /metrics

    def distinct(self) -> bool:
        return len({self.rpc, self.ddp, self.preflight, self.monitor}) == 4


@dataclass(frozen=True)
class Member:
    role: str  # a role of the job's kind: master, stage, ps, trainer
    index: int  # within its role
    rpc_name: str  # master, stage0, ps, trainer1, ...

    @property
    def label(self) -> str:
        """`<role>-<index>`: the suffix of the pod name."""
        return f"{self.role}-{self.index}"


@dataclass(frozen=True)
class Seat:
    """A member's place in a collective group (e.g. a HybridJob trainer's in DDP)."""

    group: str
    rank: int
    size: int
    address: str  # of the group's rank 0, which holds its rendezvous
    port: int
    backend: str


@dataclass(frozen=True)
class Process:
    member: Member
    rank: int
    world_size: int
    gpus: int
    address: str
    env: dict[str, str]
    seat: Seat | None = None

    @property
    def role(self) -> str:
        return self.member.role

    @property
    def rpc_name(self) -> str:
        return self.member.rpc_name


# Maps a member to the address other processes reach it at.
Addresser = Callable[[Member], str]


def members(job: Job) -> list[Member]:
    """The world's members in RPC rank order: the master first, then each role in turn."""
    return [
        Member(role.name, i, role.rpc_name(i))
        for role in job.definition.roles
        for i in range(role.members(job.spec))
    ]


def gpus_for(job: Job, member: Member) -> int:
    field = job.definition.role(member.role).gpus
    return job.spec[field] if field else 0


def seats(job: Job, world: list[Member], address: Addresser, ports: Ports) -> dict[Member, Seat]:
    """Each group member's seat: ranks in role order, the rendezvous on rank 0's address."""
    out = {}
    for group in job.definition.groups:
        inside = [m for m in world if m.role == group.role]
        backend = group.backend(job.spec)
        for rank, m in enumerate(inside):
            out[m] = Seat(group.name, rank, len(inside), address(inside[0]), ports.ddp, backend)
    return out


def plan_world(job: Job, address: Addresser, ports: Ports = Ports()) -> list[Process]:
    """Every process of the job with its rank, GPUs, address, group seat and complete env."""
    if not ports.distinct():
        raise ValueError(f"the job's ports must differ, got {ports}")
    world = members(job)
    places = seats(job, world, address, ports)
    base = {
        c.MASTER_ADDR: address(world[0]),
        c.MASTER_PORT: str(ports.rpc),
        c.WORLD_SIZE: str(len(world)),
        c.KIND: job.kind,
        c.JOB: job.name,
        c.WORLD: ",".join(m.rpc_name for m in world),
        c.ROLES: ",".join(m.role for m in world),
        c.ADDRESSES: ",".join(address(m) for m in world),
        c.PREFLIGHT_PORT: str(ports.preflight),
        c.MONITOR_PORT: str(ports.monitor),
        c.SPEC: job.spec_json,
        c.RENDEZVOUS_TIMEOUT: str(job.spec["rendezvousTimeoutSeconds"]),
    }
    processes = []
    for rank, member in enumerate(world):
        gpus = gpus_for(job, member)
        env = base | {
            c.RANK: str(rank),
            c.ROLE: member.role,
            c.ROLE_INDEX: str(member.index),
            c.RPC_NAME: member.rpc_name,
            c.GPUS: str(gpus),
        }
        seat = places.get(member)
        if seat is not None:
            env |= {
                c.DDP_ADDR: seat.address,
                c.DDP_PORT: str(seat.port),
                c.DDP_RANK: str(seat.rank),
                c.DDP_WORLD_SIZE: str(seat.size),
                c.DDP_BACKEND: seat.backend,
            }
        processes.append(Process(member, rank, len(world), gpus, address(member), env, seat))
    return processes
