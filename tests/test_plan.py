"""The world plan, checked exhaustively over job shapes."""

import json
import re

import pytest

from pipejob.core import contract as c
from pipejob.core import spec
from pipejob.core.plan import Ports, members, plan_world

COMMON_ENV = {
    c.MASTER_ADDR,
    c.MASTER_PORT,
    c.RANK,
    c.WORLD_SIZE,
    c.KIND,
    c.JOB,
    c.ROLE,
    c.ROLE_INDEX,
    c.RPC_NAME,
    c.WORLD,
    c.ROLES,
    c.SPEC,
    c.GPUS,
    c.RENDEZVOUS_TIMEOUT,
    c.ADDRESSES,
    c.PREFLIGHT_PORT,
    c.MONITOR_PORT,
    c.REPLICA,
}
DDP_ENV = {c.DDP_GROUP, c.DDP_ADDR, c.DDP_PORT, c.DDP_RANK, c.DDP_WORLD_SIZE, c.DDP_BACKEND}
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


def job(kind, **fields):
    return spec.parse(
        {
            "apiVersion": "pipejob.dev/v1alpha1",
            "kind": kind,
            "metadata": {"name": "j" * spec.MAX_JOB_NAME},  # the longest name allowed
            "spec": fields,
        }
    )


def k8s_address(j):
    return lambda m: f"{j.name}-{m.label}.{j.name}"


SHAPES = [
    # resnet152 has the most places to cut (56): the most stages a pipeline can have.
    *(
        ("PipelineJob", {"model": "resnet152", "stages": s, "gpusPerStage": g})
        for s in (2, 3, 8, 56)
        for g in (0, 1)
    ),
    # the rpc engine's replicas: a dp group per stage
    *(
        ("PipelineJob", {"engine": "rpc", "stages": s, "replicas": r})
        for s in (2, 3, 7)
        for r in (2, 3, 4)
    ),
    *(
        ("PipelineJob", {"engine": "pipelining", "stages": s, "replicas": r, "gpusPerStage": g})
        for s in (2, 4)
        for r in (1, 3)
        for g in (0, 1)
    ),
    *(("HybridJob", {"trainers": t, "gpusPerTrainer": g}) for t in (1, 2, 5, 256) for g in (0, 1)),
]


@pytest.mark.parametrize(("kind", "fields"), SHAPES, ids=lambda v: str(v))
def test_world_invariants(kind, fields):
    j = job(kind, **fields)
    ports = Ports(rpc=29500, ddp=29501, preflight=29502, monitor=29503)
    world = plan_world(j, k8s_address(j), ports)

    # ranks dense and unique, master at 0, world size agreed by everyone
    assert [p.rank for p in world] == list(range(len(world)))
    assert world[0].role == "master"
    assert all(p.world_size == len(world) for p in world)
    assert len({p.rpc_name for p in world}) == len(world)
    assert [p.rpc_name for p in world] == [m.rpc_name for m in members(j)]

    # pod names are DNS labels, addresses are the pods' DNS names
    for p in world:
        assert DNS_LABEL.fullmatch(f"{j.name}-{p.member.label}"), p.member.label

    trainers = [p for p in world if p.role == "trainer"]
    for p in world:
        env = p.env
        # Replicated stages, and every stage where the pipelining engine may run (auto, the
        # default, and pipelining), are in a group.
        grouped_stages = fields.get("replicas", 1) > 1 or fields.get("engine", "auto") != "rpc"
        grouped = p.role == "trainer" or (p.role == "stage" and grouped_stages)
        every = {c.GROUPS} if kind == "HybridJob" or grouped_stages else set()  # the world's
        expected = COMMON_ENV | every | (DDP_ENV if grouped else set())
        assert set(env) == expected, p.rpc_name
        assert all(isinstance(v, str) and v for v in env.values())
        assert env[c.RANK] == str(p.rank) and env[c.RPC_NAME] == p.rpc_name
        assert env[c.MASTER_ADDR] == world[0].address
        assert env[c.WORLD].split(",") == [q.rpc_name for q in world]
        assert env[c.ADDRESSES].split(",") == [q.address for q in world]
        ports_used = [env[c.MASTER_PORT], env[c.PREFLIGHT_PORT], env[c.MONITOR_PORT]]
        assert len(set(ports_used + [env.get(c.DDP_PORT)])) == 4
        assert json.loads(env[c.SPEC]) == j.spec
        # ports distinct: the DDP group never shares the RPC rendezvous
        assert env[c.MASTER_PORT] == "29500"
        if p.role == "trainer":
            assert env[c.DDP_PORT] == "29501" != env[c.MASTER_PORT]
            assert env[c.DDP_ADDR] == trainers[0].address
            assert env[c.DDP_BACKEND] == ("nccl" if p.gpus else "gloo")

    # the DDP group holds exactly the trainers, ranked densely (replicated stages: below)
    if kind == "HybridJob":
        ddp = [p for p in world if p.seat is not None]
        assert ddp == trainers
        assert sorted(p.seat.rank for p in ddp) == list(range(len(trainers)))
        assert all(p.seat.size == len(trainers) for p in ddp)

    # GPUs only where the spec asks for them
    gpu_role = "stage" if kind == "PipelineJob" else "trainer"
    per_role = j.spec.get("gpusPerStage", j.spec.get("gpusPerTrainer"))
    for p in world:
        assert p.gpus == (per_role if p.role == gpu_role else 0)


def test_roles_and_counts():
    pj = plan_world(job("PipelineJob", stages=3), lambda m: "127.0.0.1")
    assert [p.rpc_name for p in pj] == ["master", "stage0", "stage1", "stage2"]
    hj = plan_world(job("HybridJob", trainers=2), lambda m: "127.0.0.1")
    assert [(p.rpc_name, p.rank) for p in hj] == [
        ("master", 0),
        ("ps0", 1),
        ("trainer0", 2),
        ("trainer1", 3),
    ]


def test_addresses_are_an_input():
    j = job("HybridJob", trainers=3)
    table = {m.label: f"host-{i}" for i, m in enumerate(members(j))}
    world = plan_world(j, lambda m: table[m.label])
    assert [p.address for p in world] == list(table.values())
    assert {p.env[c.MASTER_ADDR] for p in world} == {"host-0"}
    assert {p.env[c.DDP_ADDR] for p in world if p.role == "trainer"} == {table["trainer-0"]}


def test_same_ports_refused():
    with pytest.raises(ValueError, match="must differ"):
        plan_world(job("HybridJob"), lambda m: "127.0.0.1", Ports(rpc=1234, ddp=1234))
    with pytest.raises(ValueError, match="must differ"):
        plan_world(job("HybridJob"), lambda m: "127.0.0.1", Ports(monitor=29500))


def test_plan_is_pure():
    j = job("PipelineJob", stages=4)
    first = plan_world(j, k8s_address(j))
    assert first == plan_world(j, k8s_address(j))


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("stages", [2, 3, 5])
def test_replicas_form_one_group_per_stage(stages, replicas):
    """The rpc engine's replicas: stage i's average in a group of their own."""
    j = job("PipelineJob", engine="rpc", stages=stages, replicas=replicas)
    group_ports = tuple(30000 + g for g in range(stages))
    world = plan_world(j, k8s_address(j), Ports(groups=group_ports))
    stage_procs = [p for p in world if p.role == "stage"]
    assert len(world) == 1 + stages * replicas

    # Replica by replica, stage by stage, each member knowing both.
    assert [(p.member.replica, p.member.index) for p in stage_procs] == [
        (r, i) for r in range(replicas) for i in range(stages)
    ]
    for p in stage_procs:
        assert p.env[c.REPLICA] == str(p.member.replica)
        assert p.env[c.ROLE_INDEX] == str(p.member.index)
    names = [p.rpc_name for p in stage_procs]
    if replicas == 1:
        assert names == [f"stage{i}" for i in range(stages)]
        assert all(p.seat is None for p in world)  # one pipeline: no group, no port
        return
    assert names == [f"r{r}-stage{i}" for r in range(replicas) for i in range(stages)]
    assert [p.member.label for p in stage_procs][:2] == ["r0-stage-0", "r0-stage-1"]

    # Stage i of every replica forms group dp<i>: ranks are replicas, the rendezvous on
    # replica 0's stage i, at the group's own port.
    for i in range(stages):
        members_i = [p for p in stage_procs if p.member.index == i]
        seats = [p.seat for p in members_i]
        assert {s.group for s in seats} == {f"dp{i}"}
        assert [s.rank for s in seats] == list(range(replicas))
        assert {s.size for s in seats} == {replicas}
        assert {s.address for s in seats} == {members_i[0].address}
        assert {s.port for s in seats} == {group_ports[i]}
        assert {p.env[c.DDP_PORT] for p in members_i} == {str(group_ports[i])}
    assert world[0].seat is None  # the master drives; it is in no group
    layout = ";".join(
        f"dp{i}=" + ",".join(str(1 + r * stages + i) for r in range(replicas))
        for i in range(stages)
    )
    assert {p.env[c.GROUPS] for p in world} == {layout}
    # By default every group has a port of its own, none of the world's others.
    default = plan_world(j, k8s_address(j))
    ports = sorted({p.seat.port for p in default if p.seat is not None})
    assert ports == [29501, *range(29511, 29510 + stages)]


@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize("gpus", [0, 1])
def test_the_pipelining_engine_seats_every_stage_in_one_group(replicas, gpus):
    """Its PipelineStages exchange activations within a replica and all-reduce gradients
    across replicas: one group of every stage, on replica 0's first stage, which both
    divide (rank r * stages + i is stage i of replica r); the master is in none."""
    stages = 3
    j = job(
        "PipelineJob",
        engine="pipelining",
        stages=stages,
        replicas=replicas,
        gpusPerStage=gpus,
        microBatches=4,
    )
    world = plan_world(j, k8s_address(j), Ports(groups=(30000,)))
    stage_procs = [p for p in world if p.role == "stage"]
    assert world[0].seat is None
    seats = [p.seat for p in stage_procs]
    assert {s.group for s in seats} == {"pipe"}
    assert [s.rank for s in seats] == [
        p.member.replica * stages + p.member.index for p in stage_procs
    ]
    assert {s.size for s in seats} == {stages * replicas}
    assert {(s.address, s.port) for s in seats} == {(stage_procs[0].address, 30000)}
    assert {s.backend for s in seats} == {"nccl" if gpus else "gloo"}
    assert {p.env[c.GROUPS] for p in world} == {
        "pipe=" + ",".join(str(1 + k) for k in range(stages * replicas))
    }


def test_group_ports_must_differ_from_the_others():
    with pytest.raises(ValueError, match="must differ"):
        plan_world(job("PipelineJob", replicas=2), lambda m: "127.0.0.1", Ports(groups=(29500,)))
