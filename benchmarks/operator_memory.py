"""Does the operator's memory grow with the jobs it has seen? Rounds of jobs made, run to
success and deleted, against the unmodified operator (`pipejob operator`, a process) on the
emulated cluster (issue 60). Each round: `--jobs` jobs of both kinds created at once, the
stand-in node of benchmarks/chaos.py runs each world (every pod Running, the master exits 0
after its steps), every job deleted, and its pods gone; then the operator's RSS. An operator
that keeps something per job it has seen (a lock, a cache, a metric's series) grows round by
round; one that forgets a deleted job levels off after the first rounds (the interpreter
keeps the memory it once used, so RSS never falls).

    python benchmarks/operator_memory.py --rounds 10 --jobs 100

It prints each round and the growth per job over the second half; it asserts nothing."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import yaml
from _chaos_checks import WorkKept
from _chaos_node import Node
from _cluster import NAMESPACE, LeanApiServer, Operator
from _common import REPO, load_average, machine
from chaos import Statuses
from operator_scale import manifest

sys.path.insert(0, str(REPO / "tests"))
import harness.cluster  # the tests' harness lives in tests/
from harness import jobs
from harness.cluster import Cluster

say = print


def wait(what: str, done, timeout: float, node: Node) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout:g}s")
        node.tick(time.monotonic())
        time.sleep(0.2)


def one_round(c: Cluster, node: Node, statuses: Statuses, names: dict[str, dict], timeout: float):
    """Make the jobs `names`, run them to success, delete them, wait for their pods to go."""
    for name, made in names.items():
        node.pace[name] = 0.05
        jobs.create(c.api, made, NAMESPACE)

    def succeeded() -> bool:
        with statuses.lock:
            return all((statuses.latest.get(n) or {}).get("phase") == "Succeeded" for n in names)

    wait("not every job Succeeded", succeeded, timeout, node)
    for name, made in names.items():
        c.api.delete(jobs.resource(made["kind"]), name, NAMESPACE)
    wait("pods left", lambda: not c.api.list("v1/pods", NAMESPACE), timeout, node)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=100, help="jobs made and deleted each round")
    ap.add_argument("--resync", type=float, default=10.0, help="PIPEJOB_RESYNC_SECONDS")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a round may take")
    args = ap.parse_args(argv)
    harness.cluster.ApiServer = LeanApiServer
    say(f"operator_memory: {args.rounds} rounds of {args.jobs} jobs; {machine()}", flush=True)
    rss = []
    with tempfile.TemporaryDirectory(prefix="pipejob-opmem-") as tmp, Cluster(Path(tmp)) as c:
        for path in sorted((REPO / "crds").glob("*.yaml")):
            jobs.apply_crd(c.api, yaml.safe_load(path.read_text()))
        operator = Operator(c.kubeconfig, Path(tmp) / "operator.log", "info", args.resync)
        node, statuses = Node(c.api, {}, WorkKept()), Statuses(c.api)
        try:
            operator.wait_healthy()
            say(f"  operator up: RSS {operator.memory()[0]:.1f} MB", flush=True)
            for k in range(args.rounds):
                started, cpu = time.monotonic(), operator.cpu_seconds()
                asked = LeanApiServer.operator_requests
                names = {
                    f"m{k}-{i}": manifest(f"m{k}-{i}", ("2", "hybrid")[i % 2])
                    for i in range(args.jobs)
                }
                one_round(c, node, statuses, names, args.timeout)
                time.sleep(2 * args.resync)  # a resync or two after the deletions
                rss.append(operator.memory()[0])
                say(
                    f"  round {k + 1}: {args.jobs * (k + 1)} jobs made and deleted; RSS"
                    f" {rss[-1]:.1f} MB; {time.monotonic() - started:.0f} s,"
                    f" {operator.cpu_seconds() - cpu:.1f} operator CPU-s,"
                    f" {(LeanApiServer.operator_requests - asked) / args.jobs:.1f} requests/job;"
                    f" {load_average()}",
                    flush=True,
                )
        finally:
            operator.stop()
    half = len(rss) // 2
    if half:
        grown = (rss[-1] - rss[half - 1]) * 1024 / (args.jobs * (len(rss) - half))
        say(f"growth over the last {len(rss) - half} rounds: {grown:.2f} kB per job")
    return 0


if __name__ == "__main__":
    sys.exit(main())
