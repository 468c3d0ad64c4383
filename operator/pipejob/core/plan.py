"""The world plan: one pure function from a validated job to its processes.

The operator renders the plan as Pods, the local runner as processes; neither rebuilds it."""

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
    ddp: int = 29501  # HybridJob: the trainers' DDP group, on trainer 0
    preflight: int = 29502  # the whole world's gloo group for the preflight check, on the master
    monitor: int = 29503  # the master's HTTP endpoint: /progress (JSON) and /metrics

    def distinct(self) -> bool:
        return len({self.rpc, self.ddp, self.preflight, self.monitor}) == 4


@dataclass(frozen=True)
class Member:
    role: str  # master | stage | ps | trainer
    index: int

    @property
    def rpc_name(self) -> str:
        return self.role if self.role in ("master", "ps") else f"{self.role}{self.index}"

    @property
    def label(self) -> str:
        """`<role>-<index>`: the suffix of the pod name."""
        return f"{self.role}-{self.index}"


@dataclass(frozen=True)
class Process:
    member: Member
    rank: int
    world_size: int
    gpus: int
    address: str
    env: dict[str, str]
    ddp_rank: int | None = None
    ddp_world_size: int | None = None

    @property
    def role(self) -> str:
        return self.member.role

    @property
    def rpc_name(self) -> str:
        return self.member.rpc_name


# Maps a member to the address other processes reach it at.
Addresser = Callable[[Member], str]


def members(job: Job) -> list[Member]:
    """The world's members in RPC rank order: master first."""
    if job.kind == "PipelineJob":
        return [Member("master", 0)] + [Member("stage", i) for i in range(job.spec["stages"])]
    if job.kind == "HybridJob":
        trainers = [Member("trainer", k) for k in range(job.spec["trainers"])]
        return [Member("master", 0), Member("ps", 0), *trainers]
    raise ValueError(f"unknown kind {job.kind}")


def gpus_for(job: Job, member: Member) -> int:
    if job.kind == "PipelineJob" and member.role == "stage":
        return job.spec["gpusPerStage"]
    if job.kind == "HybridJob" and member.role == "trainer":
        return job.spec["gpusPerTrainer"]
    return 0


def plan_world(job: Job, address: Addresser, ports: Ports = Ports()) -> list[Process]:
    """Every process of the job with its rank, GPUs, address and complete env."""
    if not ports.distinct():
        raise ValueError(f"the job's ports must differ, got {ports}")
    world = members(job)
    master_addr = address(world[0])
    trainers = [m for m in world if m.role == "trainer"]
    ddp_addr = address(trainers[0]) if trainers else None
    base = {
        c.MASTER_ADDR: master_addr,
        c.MASTER_PORT: str(ports.rpc),
        c.WORLD_SIZE: str(len(world)),
        c.KIND: job.kind,
        c.JOB: job.name,
        c.WORLD: ",".join(m.rpc_name for m in world),
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
        ddp_rank = ddp_size = None
        if member.role == "trainer":
            ddp_rank, ddp_size = member.index, len(trainers)
            env |= {
                c.DDP_ADDR: ddp_addr,
                c.DDP_PORT: str(ports.ddp),
                c.DDP_RANK: str(ddp_rank),
                c.DDP_WORLD_SIZE: str(ddp_size),
                c.DDP_BACKEND: job.spec["backend"],
            }
        processes.append(
            Process(member, rank, len(world), gpus, address(member), env, ddp_rank, ddp_size)
        )
    return processes
