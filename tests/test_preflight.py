"""Preflight: the whole world's communication check, with real trainer processes on loopback.

Worlds are started from the world plan by hand, so one member can be left out or replaced."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from pipejob.core import plan, spec
from pipejob.runner.local import LOOPBACK, free_ports
from pipejob.trainer.runtime import preflight, world

TIMEOUT = 8  # preflight.timeoutSeconds of these worlds
SLACK = 60  # process start-up (importing torch on a busy machine) and teardown


def job(timeout: int = TIMEOUT, megabytes: float = 0.5) -> spec.Job:
    return spec.parse(
        {
            "apiVersion": "pipejob.dev/v1alpha1",
            "kind": "PipelineJob",
            "metadata": {"name": "preflight"},
            "spec": {
                "model": "resnet18",
                "stages": 2,
                "imageSize": 32,
                "numClasses": 10,
                "batchSize": 4,
                "microBatches": 2,
                "steps": 1,
                "rendezvousTimeoutSeconds": 60,
                "preflight": {"timeoutSeconds": timeout, "megabytes": megabytes},
            },
        }
    )


def world_plan(j: spec.Job) -> list[plan.Process]:
    return plan.plan_world(j, lambda m: LOOPBACK, plan.Ports(*free_ports(4)))


@contextmanager
def started(
    processes: list[plan.Process], tmp: Path, stagger: float = 0.0
) -> Iterator[dict[str, subprocess.Popen]]:
    """The trainers of `processes`, in this order, `stagger` seconds apart, each with its own
    termination-message file; every one of them is killed on the way out, whatever happened."""
    running: dict[str, subprocess.Popen] = {}
    try:
        for p in processes:
            if running:
                time.sleep(stagger)
            running[p.rpc_name] = subprocess.Popen(
                [sys.executable, *plan.TRAINER_MODULE],
                env=os.environ
                | p.env
                | {
                    world.TERMINATION_LOG_ENV: str(tmp / f"{p.rpc_name}.termination"),
                    "PYTHONUNBUFFERED": "1",
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                process_group=0,
            )
        yield running
    finally:
        for popen in running.values():
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            popen.wait()


def finish(popen: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        output, _ = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        output, _ = popen.communicate()
        pytest.fail(f"the process did not exit within {timeout}s; output:\n{output}")
    return popen.returncode, output


@pytest.mark.timeout(150)
def test_a_peer_that_never_comes_up_is_named_within_the_deadline(tmp_path: Path) -> None:
    master, stage0, missing = world_plan(job())
    assert missing.rpc_name == "stage1"
    # stage0 starts first: it waits for the master longer than the master waits for stage1.
    with started([stage0, master], tmp_path, stagger=3) as running:
        # The subprocess timeout is the bound: the deadline plus start-up and teardown.
        code, output = finish(running["master"], TIMEOUT + SLACK)
        stage_code, stage_output = finish(running["stage0"], SLACK)
    named = "rank 2 (stage1, role stage, address 127.0.0.1)"
    assert code == 4, output
    assert f"error: preflight: no answer within {TIMEOUT}s from {named}" in output, output
    message = (tmp_path / "master.termination").read_text()
    assert message.startswith("preflight: no answer") and named in message, message
    assert "\n" not in message.rstrip("\n")  # one line, as a termination message
    # The one that came up learns why the world stops, and says so too.
    assert stage_code == 4, stage_output
    assert (
        f"preflight: the master reports: preflight: no answer within {TIMEOUT}s from {named}"
        in stage_output
    ), stage_output
    assert (tmp_path / "stage0.termination").read_text().startswith("preflight:")


def _wrong_peer(environ: dict[str, str], contribution: float) -> None:
    """A member that follows the preflight protocol but adds a wrong value in the
    all_reduce; it takes part in the links honestly."""
    os.environ.update(environ)
    env = world.read_env()
    timeout = env.spec.preflight.timeout_seconds
    deadline = time.monotonic() + timeout
    store = preflight._store(env, deadline, timeout)
    store.set(f"checkin/{env.rank}", "{}")
    preflight._verdict(env, store, "checkin", deadline, timeout)
    group = preflight._group(env, store, deadline)
    wrong = torch.zeros(env.world_size, dtype=torch.float64)
    wrong[env.rank] = contribution
    group.allreduce([wrong]).wait()
    preflight._links(env, group, env.spec.preflight.megabytes)
    group.shutdown()
    store.set(f"result/{env.rank}", json.dumps({"problems": [], "links": []}))
    try:
        preflight._verdict(env, store, "final", deadline, timeout)
    except world.PreflightError:
        pass
    store.set(f"bye/{env.rank}", "1")


@pytest.mark.timeout(150)
def test_a_peer_answering_wrongly_in_the_all_reduce_is_named(tmp_path: Path) -> None:
    processes = world_plan(job(timeout=30))
    rogue = processes[2]
    context = multiprocessing.get_context("spawn")
    peer = context.Process(target=_wrong_peer, args=(rogue.env, 99.0), daemon=True)
    with started(processes[:2], tmp_path) as running:
        peer.start()
        try:
            code, output = finish(running["master"], 30 + SLACK)
        finally:
            peer.kill()
            peer.join()
    assert code == 4, output
    # Every rank saw the same wrong entry; the master names whose it is, once per observer.
    wrong = "the entry of rank 2 (stage1, role stage, address 127.0.0.1) is 99, expected 3"
    assert (
        f"all_reduce seen by rank 0 (master, role master, address 127.0.0.1): {wrong}" in output
    ), output
    assert (
        f"all_reduce seen by rank 1 (stage0, role stage, address 127.0.0.1): {wrong}" in output
    ), output
    # The ring still ran: the links that do not involve the wrong peer were measured.
    assert (tmp_path / "master.termination").read_text().startswith("preflight: all_reduce")


# ------------------------------------------------------------------ pure pieces


def test_the_link_table_names_both_ends_with_latency_and_bandwidth() -> None:
    env = world.read_env(world_plan(job())[0].env)
    links = [
        preflight.Link(0, 1, 85e-6, 1.2e9),
        preflight.Link(2, 0, 1.5e-3, 250e6),
        preflight.Link(1, 2, 60e-6, 2.5e9),
    ]
    lines = preflight.table(env, links)
    assert lines[0].split() == ["link", "latency", "bandwidth"]
    assert lines[1].split() == ["master", "->", "stage0", "85", "us", "1.20", "GB/s"]
    assert lines[2].split() == ["stage0", "->", "stage1", "60", "us", "2.50", "GB/s"]
    assert lines[3].split() == ["stage1", "->", "master", "1500", "us", "250.0", "MB/s"]


def test_payloads_differ_by_sender_and_round() -> None:
    a = preflight.payload(0, 0, 1000)
    assert torch.equal(a, preflight.payload(0, 0, 1000))
    assert not torch.equal(a, preflight.payload(1, 0, 1000))
    assert not torch.equal(a, preflight.payload(0, 1, 1000))


@pytest.mark.parametrize(
    ("kind", "fields", "spokes"),
    [
        ("PipelineJob", {"stages": 2}, []),  # one pipeline: the ring is every link there is
        # the rpc engine's replicas: a dp group per stage
        (
            "PipelineJob",
            {"engine": "rpc", "stages": 2, "replicas": 3},
            [(1, 3), (1, 5), (2, 4), (2, 6)],
        ),
        ("HybridJob", {"trainers": 3}, [(2, 4)]),  # trainer0 -> trainer1 is in the ring
    ],
)
def test_the_check_covers_the_ring_and_every_group(kind, fields, spokes) -> None:
    job = spec.parse(
        {
            "apiVersion": "pipejob.dev/v1alpha1",
            "kind": kind,
            "metadata": {"name": "links"},
            "spec": fields,
        }
    )
    processes = plan.plan_world(job, lambda m: LOOPBACK, plan.Ports(groups=(40001, 40002)))
    env = world.read_env(processes[0].env)
    n = len(processes)
    assert preflight.pairs(env) == [(r, (r + 1) % n) for r in range(n)] + spokes
