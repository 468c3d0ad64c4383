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
    ddp: int = 29501  # a collective group's rendezvous (HybridJob's DDP), on the group's rank 0
    preflight: int = 29502  # the whole world's gloo group for the preflight check, on the master
    monitor: int = 29503  # the master's HTTP endpoint: /progress (JSON) and /metrics
    # The port of each collective group: a group's rendezvous listens on every address of its
    # rank 0, so groups whose ranks 0 share a network (host-network pods, the local runner)
    # need ports of their own. Empty: group 0 on `ddp`, group g on `more_groups + g`.
    groups: tuple[int, ...] = ()
    more_groups: int = 29510

    def group_port(self, g: int) -> int:
        if self.groups:
            return self.groups[g]
        return self.ddp if g == 0 else self.more_groups + g

    def all_distinct(self) -> bool:
        every = [self.rpc, self.ddp, self.preflight, self.monitor, *self.groups]
        return len(set(every)) == len(every)


@dataclass(frozen=True)
class Member:
    role: str  # a role of the job's kind: master, stage, ps, trainer
    index: int  # within its role (and replica)
    rpc_name: str  # master, stage0, ps, trainer1, r1-stage0, ...
    replica: int = 0
    replicated: bool = False  # the role has several replicas: names carry the replica

    @property
    def label(self) -> str:
        """The suffix of the pod name: `<role>-<index>`, `r<replica>-<role>-<index>`."""
        label = f"{self.role}-{self.index}"
        return f"r{self.replica}-{label}" if self.replicated else label


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
    """The world's members in RPC rank order: the master first, then each role in turn, a
    replicated role replica by replica."""
    out = []
    shape = job.shape
    for role in job.definition.roles:
        replicas = role.copies(shape)
        for r in range(replicas):
            for i in range(role.members(shape)):
                name = role.rpc_name(i, r, replicas > 1)
                out.append(Member(role.name, i, name, r, replicas > 1))
    return out


def groups(job: Job, world: list[Member]) -> list[tuple[str, str, list[Member]]]:
    """Every collective group of the world: (name, backend, members in group rank order)."""
    out = []
    shape = job.shape
    for group in job.definition.groups:
        if not group.when(shape):
            continue
        inside = [m for m in world if m.role == group.role]
        backend = group.backend(shape)
        if group.by_index:
            for i in sorted({m.index for m in inside}):
                out.append((f"{group.name}{i}", backend, [m for m in inside if m.index == i]))
        else:
            out.append((group.name, backend, inside))
    return out


def gpus_for(job: Job, member: Member) -> int:
    """The GPUs of the member's process: its role's settings field, or none."""
    field = job.definition.role(member.role).gpus
    return getattr(job.settings, field) if field else 0


def seats(job: Job, world: list[Member], address: Addresser, ports: Ports) -> dict[Member, Seat]:
    """Each group member's seat: its rank in the group, the rendezvous on rank 0's address at
    the group's port."""
    out = {}
    for g, (name, backend, inside) in enumerate(groups(job, world)):
        for rank, m in enumerate(inside):
            out[m] = Seat(name, rank, len(inside), address(inside[0]), ports.group_port(g), backend)
    return out


def plan_world(job: Job, address: Addresser, ports: Ports = Ports()) -> list[Process]:
    """Every process of the job with its rank, GPUs, address, group seat and complete env."""
    if not ports.all_distinct():
        raise ValueError(f"the job's ports must differ, got {ports}")
    world = members(job)
    places = seats(job, world, address, ports)
    ranks = {m: rank for rank, m in enumerate(world)}
    layout = ";".join(
        f"{name}=" + ",".join(str(ranks[m]) for m in inside)
        for name, _, inside in groups(job, world)
    )
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
        c.RENDEZVOUS_TIMEOUT: str(job.settings.rendezvous_timeout_seconds),
    } | ({c.GROUPS: layout} if layout else {})
    processes = []
    for rank, member in enumerate(world):
        gpus = gpus_for(job, member)
        env = base | {
            c.RANK: str(rank),
            c.ROLE: member.role,
            c.ROLE_INDEX: str(member.index),
            c.REPLICA: str(member.replica),
            c.RPC_NAME: member.rpc_name,
            c.GPUS: str(gpus),
        }
        seat = places.get(member)
        if seat is not None:
            env |= {
                c.DDP_GROUP: seat.group,
                c.DDP_ADDR: seat.address,
                c.DDP_PORT: str(seat.port),
                c.DDP_RANK: str(seat.rank),
                c.DDP_WORLD_SIZE: str(seat.size),
                c.DDP_BACKEND: seat.backend,
            }
        processes.append(Process(member, rank, len(world), gpus, address(member), env, seat))
    return processes
