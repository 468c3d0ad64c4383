"""Preflight: before training, every process of the world proves it can talk to the others,
in a gloo group of its own on a TCPStore at the master (check-in, a checked all_reduce, each
link's latency and bandwidth); the master prints the table and the verdict every process
acts on. The steps: docs/architecture.md, "Preflight"."""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TypedDict

import torch
import torch.distributed as dist

from pipejob.trainer.runtime import rendezvous, world
from pipejob.trainer.runtime.world import Env, PreflightError

LATENCY_ROUNDS = 20  # small ping-pongs per link, after WARMUP_ROUNDS
WARMUP_ROUNDS = 3
BANDWIDTH_ROUNDS = 3  # payload transfers per link; the fastest counts
POLL_SECONDS = 0.05
GRACE_SECONDS = 5.0  # a verdict may come this late after a deadline; the store stays up as long
WAIT_KEY = "wait/checkin"  # the master's wait for check-ins, in seconds from when it set it


@dataclass(frozen=True)
class Link:
    src: int
    dst: int
    latency: float  # seconds, one way (half the median round trip of a small message)
    bandwidth: float  # bytes per second, the fastest of BANDWIDTH_ROUNDS transfers


class CheckResult(TypedDict, total=False):
    """What a member posts of its check (JSON in the store): its problems, always, and the
    links it measured (none where it did not finish)."""

    problems: list[str]
    links: list[dict[str, float]]  # each Link's fields


@dataclass(frozen=True)
class Report:
    seconds: float
    links: list[Link]
    summary: str  # one line for status and logs


def check(env: Env, late: float = 0.0) -> Report | None:
    """Run the check if the spec asks for it (the default); raise PreflightError on failure.
    `late`: seconds after the master the others start (MASTER_FIRST: about as long as the
    master's own start took, and rendezvousTimeoutSeconds more where the operator makes their
    pods only then), which the master waits for them beside the timeout."""
    settings = env.spec.preflight
    if not settings.enabled:
        return None
    timeout, megabytes = float(settings.timeout_seconds), settings.megabytes
    started = time.monotonic()
    deadline = started + timeout + (late if env.rank == 0 else 0.0)
    store = _store(env, deadline, timeout)
    if env.rank == 0:
        return _lead(env, store, deadline, timeout, megabytes, started)
    # The master's clock started no later than its store: counting from now, this process
    # waits at least as long as the master does.
    _follow(env, store, time.monotonic() + timeout, timeout, megabytes)
    return None


# ---------------------------------------------------------------------------- the master


def _lead(
    env: Env,
    store: dist.TCPStore,
    deadline: float,
    timeout: float,
    megabytes: float,
    started: float,
) -> Report:
    present = list(range(1, env.world_size))
    # How long it waits for the others to check in: theirs wait as long for its verdict.
    store.set(WAIT_KEY, json.dumps(deadline - time.monotonic()))
    try:
        missing = _await_keys(store, "checkin", present, deadline)
        present = [r for r in present if r not in missing]
        if missing:
            others = ", ".join(world.describe(env, r) for r in missing)
            late = deadline - started - timeout  # MASTER_FIRST: allowed for their later start
            waited = f"{timeout:g}s" + (
                f" and {late:.0f}s more (they start after the master's check)" if late >= 1 else ""
            )
            raise PreflightError(
                f"no answer within {waited} from {others}: it never started, or cannot"
                f" reach the master at {env.master_addr}:{env.preflight_port}"
            )
        checked_in = time.monotonic() - started
        world.log(
            env, f"preflight: all {env.world_size} processes checked in after {checked_in:.1f}s"
        )
        store.set("verdict/checkin", json.dumps({"ok": True}))
        _measure(env, store, deadline, megabytes)
        results = _results(env, store, deadline, timeout)
        problems = [p for r in results.values() for p in r["problems"]]
        links = [Link(**link) for r in results.values() for link in r.get("links", [])]
        if problems:
            raise PreflightError("; ".join(problems))
    except PreflightError as e:
        store.set("verdict/final", json.dumps({"ok": False, "message": str(e)}))
        store.set("verdict/checkin", json.dumps({"ok": False, "message": str(e)}))
        _say_goodbye(store, present)
        raise
    report = Report(time.monotonic() - started, links, _summary(links))
    store.set("verdict/final", json.dumps({"ok": True}))
    for line in table(env, links):
        world.log(env, f"preflight: {line}")
    world.log(env, f"preflight: passed in {report.seconds:.1f}s ({report.summary})")
    _say_goodbye(store, present)
    return report


def _results(
    env: Env, store: dist.TCPStore, deadline: float, timeout: float
) -> dict[int, CheckResult]:
    """Each rank's posted result; one that did not post in time says so as its problem."""
    missing = _await_keys(store, "result", range(env.world_size), deadline)
    results = {
        r: json.loads(store.get(f"result/{r}")) for r in range(env.world_size) if r not in missing
    }
    for r in missing:
        late = f"{world.describe(env, r)} did not finish the check within {timeout:g}s"
        results[r] = CheckResult(problems=[late])
    return results


def _say_goodbye(store: dist.TCPStore, ranks: list[int]) -> None:
    """Keep the store up until these ranks read the verdict (or a few seconds passed)."""
    _await_keys(store, "bye", ranks, time.monotonic() + GRACE_SECONDS)


def table(env: Env, links: list[Link]) -> list[str]:
    width = max(len(n) for n in env.world)
    lines = [f"{'link':<{2 * width + 4}} {'latency':>10} {'bandwidth':>12}"]
    for link in sorted(links, key=lambda k: k.src):
        name = f"{env.world[link.src]} -> {env.world[link.dst]}"
        lines.append(
            f"{name:<{2 * width + 4}} {link.latency * 1e6:>7.0f} us {_rate(link.bandwidth):>12}"
        )
    return lines


def _summary(links: list[Link]) -> str:
    if not links:
        return "no links to measure"
    latencies = [k.latency * 1e6 for k in links]
    slowest = min(k.bandwidth for k in links)
    return (
        f"{len(links)} links, latency {min(latencies):.0f}-{max(latencies):.0f} us,"
        f" bandwidth at least {_rate(slowest)}"
    )


def _rate(bytes_per_second: float) -> str:
    if bytes_per_second >= 1e9:
        return f"{bytes_per_second / 1e9:.2f} GB/s"
    return f"{bytes_per_second / 1e6:.1f} MB/s"


# ---------------------------------------------------------------------------- everyone else


def _follow(
    env: Env, store: dist.TCPStore, deadline: float, timeout: float, megabytes: float
) -> None:
    info = {"host": socket.gethostname(), "pid": os.getpid()}
    store.set(f"checkin/{env.rank}", json.dumps(info))
    deadline = max(deadline, time.monotonic() + _master_wait(store))  # MASTER_FIRST's longer
    try:
        _verdict(env, store, "checkin", deadline + GRACE_SECONDS, timeout)
        _measure(env, store, deadline, megabytes)
        _verdict(env, store, "final", deadline + GRACE_SECONDS, timeout)
    finally:
        try:
            store.set(f"bye/{env.rank}", "1")
        except RuntimeError:
            pass  # the master is gone; nothing to say goodbye to


def _master_wait(store: dist.TCPStore) -> float:
    """The seconds the master said it waits for check-ins (0 where it has not said yet)."""
    return float(json.loads(store.get(WAIT_KEY))) if store.check([WAIT_KEY]) else 0.0


def _verdict(env: Env, store: dist.TCPStore, which: str, deadline: float, timeout: float) -> None:
    key = f"verdict/{which}"
    try:
        store.wait([key], timedelta(seconds=max(0.001, deadline - time.monotonic())))
        verdict = json.loads(store.get(key))
    except RuntimeError:  # timed out, or the master's store went away
        raise PreflightError(
            f"{world.describe(env, 0)} gave no verdict within {timeout:g}s"
        ) from None
    if not verdict["ok"]:
        raise PreflightError(f"the master reports: {verdict['message']}")


# ---------------------------------------------------------------------------- shared


def _store(env: Env, deadline: float, timeout: float) -> dist.TCPStore:
    left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    if env.rank == 0:
        try:
            return rendezvous.store(
                env.master_addr, env.preflight_port, None, True, left, wait_for_workers=False
            )
        except (RuntimeError, OSError) as e:
            raise PreflightError(
                f"the master cannot listen on port {env.preflight_port}: {e}"
            ) from None
    unreachable = (
        f"{world.describe(env, env.rank)} could not reach {world.describe(env, 0)}"
        f" at {env.master_addr}:{env.preflight_port} within {timeout:g}s"
    )
    try:
        rendezvous.wait_reachable(
            env.master_addr, env.preflight_port, deadline, "the master's preflight store", env
        )
    except world.RendezvousError:
        raise PreflightError(unreachable) from None
    try:
        return rendezvous.store(
            env.master_addr, env.preflight_port, None, False, left, wait_for_workers=False
        )
    except RuntimeError as e:
        raise PreflightError(f"{unreachable}: {' '.join(str(e).split())[:200]}") from None


def _await_keys(
    store: dist.TCPStore, prefix: str, ranks: range | list[int], deadline: float
) -> list[int]:
    """Wait until `prefix/r` exists for every rank; the ranks still missing at the deadline."""
    missing = list(ranks)
    while missing:
        missing = [r for r in missing if not store.check([f"{prefix}/{r}"])]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(POLL_SECONDS)
    return missing


def _measure(env: Env, store: dist.TCPStore, deadline: float, megabytes: float) -> None:
    """This rank's part of the all_reduce and the links; publishes what it found."""
    problems: list[str] = []
    links: list[Link] = []
    group = None
    try:
        group = _group(env, store, deadline)
        problems += all_reduce_problems(env, group)
        links, found = _links(env, group, megabytes)
        problems += found
    except RuntimeError as e:  # gloo: a peer vanished or stopped answering until the timeout
        problems.append(
            f"{world.describe(env, env.rank)} could not complete the check: "
            + " ".join(str(e).split())[:300]
        )
    finally:
        if group is not None:
            group.shutdown()
    result = CheckResult(problems=problems, links=[link.__dict__ for link in links])
    store.set(f"result/{env.rank}", json.dumps(result))


def _group(env: Env, store: dist.TCPStore, deadline: float) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    interfaces = os.environ.get("GLOO_SOCKET_IFNAME")  # as torch's own gloo groups do
    if interfaces:
        options._devices = [
            dist.ProcessGroupGloo.create_device(interface=i) for i in interfaces.split(",")
        ]
    else:
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(
        dist.PrefixStore("group", store), env.rank, env.world_size, options
    )


def all_reduce_problems(env: Env, group: dist.ProcessGroup) -> list[str]:
    """Rank r adds r+1 at index r: the sum must be 1, 2, ..., n, and a wrong entry names the
    rank whose contribution went wrong."""
    n = env.world_size
    contribution = torch.zeros(n, dtype=torch.float64)
    contribution[env.rank] = env.rank + 1
    group.allreduce([contribution]).wait()
    expected = torch.arange(1, n + 1, dtype=torch.float64)
    return [
        f"all_reduce seen by {world.describe(env, env.rank)}: the entry of"
        f" {world.describe(env, r)} is {contribution[r].item():g}, expected {r + 1}"
        for r in range(n)
        if contribution[r] != expected[r]
    ]


def payload(src: int, round_: int, count: int) -> torch.Tensor:
    """What `src` sends in a bandwidth round: cheap to make, and any corruption shows."""
    return torch.arange(count, dtype=torch.float32).remainder_(65521).add_(src * 7 + round_)


def pairs(env: Env) -> list[tuple[int, int]]:
    """The links to check, in order: the ring r -> r+1, then from each collective group's
    rank 0 to its other members (what the group's all-reduce and rendezvous use)."""
    n = env.world_size
    ring = [(src, (src + 1) % n) for src in range(n)]
    spokes = [(ranks[0], r) for ranks in env.groups.values() for r in ranks[1:]]
    return ring + [p for p in spokes if p not in ring]


def _links(env: Env, group: dist.ProcessGroup, megabytes: float) -> tuple[list[Link], list[str]]:
    """Measure the links one after another; this rank measures those it sends on and checks
    what arrives on those it receives on."""
    me = env.rank
    count = max(1, int(megabytes * 1e6) // 4)
    links, problems = [], []
    for src, dst in pairs(env):
        if me == src:
            link, problems_out = _send_side(env, group, dst, count)
            links.append(link)
            problems += problems_out
        elif me == dst:
            problems += _receive_side(env, group, src, count)
    return links, problems


def _send_side(env: Env, group: dist.ProcessGroup, dst: int, count: int) -> tuple[Link, list[str]]:
    me, problems = env.rank, []
    # float32 throughout, whatever default dtype the process runs with (a user's code may
    # set float64): both sides must agree on the bytes.
    ping, pong = torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.float32)
    round_trips, wrong_echoes = [], 0
    for i in range(WARMUP_ROUNDS + LATENCY_ROUNDS):
        ping.fill_(i)
        start = time.perf_counter()
        group.send([ping], dst, 0).wait()
        group.recv([pong], dst, 1).wait()
        round_trips.append(time.perf_counter() - start)
        wrong_echoes += pong.item() != i + 1
    if wrong_echoes:
        problems.append(
            f"link {env.world[me]} -> {env.world[dst]}: {world.describe(env, dst)}"
            f" echoed {wrong_echoes} small messages wrongly"
        )
    transfers, ack = [], torch.zeros(1, dtype=torch.float32)
    for r in range(BANDWIDTH_ROUNDS):
        data = payload(me, r, count)
        start = time.perf_counter()
        group.send([data], dst, 2).wait()
        group.recv([ack], dst, 3).wait()
        transfers.append(time.perf_counter() - start)
    latency = statistics.median(round_trips[WARMUP_ROUNDS:]) / 2
    return Link(me, dst, latency, count * 4 / min(transfers)), problems


def _receive_side(env: Env, group: dist.ProcessGroup, src: int, count: int) -> list[str]:
    problems = []
    ping = torch.zeros(1, dtype=torch.float32)
    for _ in range(WARMUP_ROUNDS + LATENCY_ROUNDS):
        group.recv([ping], src, 0).wait()
        group.send([ping + 1], src, 1).wait()
    data, ack = torch.empty(count, dtype=torch.float32), torch.ones(1, dtype=torch.float32)
    for r in range(BANDWIDTH_ROUNDS):
        group.recv([data], src, 2).wait()
        group.send([ack], src, 3).wait()
        wrong = int((data != payload(src, r, count)).sum())
        if wrong:
            problems.append(
                f"link {env.world[src]} -> {env.world[env.rank]}: {wrong} of {count} values"
                f" arrived corrupted at {world.describe(env, env.rank)}"
            )
    return problems
