"""Where the operator's memory per kept job goes: the unmodified operator (`pipejob operator`,
a process, under tracemalloc) against the emulated cluster, with heap snapshots taken after
`--jobs` jobs of both kinds run and again after `--jobs` more (issue 60: 5,000 kept jobs must
fit in 300 MB). Every pod is reported Running by the stand-in node of operator_scale.py, so
the jobs are kept as a cluster's would be: Running, with their worlds.

    python benchmarks/operator_heap.py --jobs 300

It prints RSS per job, the Python heap per job, and the places whose memory grew most per job
between the two snapshots (by the line that allocated it and its callers); it asserts
nothing. tracemalloc slows the operator about twofold, and its own bookkeeping is not counted
in the heap figures but is in RSS."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import yaml
from _cluster import NAMESPACE, LeanApiServer, Operator
from _common import REPO, load_average, machine
from operator_scale import JobWatch, PodWatch, manifest

sys.path.insert(0, str(REPO / "tests"))
import harness.cluster  # the tests' harness lives in tests/
from harness import jobs
from harness.cluster import Cluster

say = print

# Loaded by the operator's interpreter (PYTHONPATH): a thread that writes a heap snapshot
# wherever the file `ask` names, when it appears.
SITECUSTOMIZE = """
import gc, os, threading, time, tracemalloc
from pathlib import Path

def _serve(ask: Path) -> None:
    while True:
        time.sleep(0.2)
        if ask.exists():
            out = ask.read_text().strip()
            ask.unlink()
            gc.collect()
            tracemalloc.take_snapshot().dump(out + ".part")
            os.replace(out + ".part", out)

if os.environ.get("PIPEJOB_HEAP_ASK"):
    tracemalloc.start(int(os.environ.get("PIPEJOB_HEAP_FRAMES", "8")))
    _ask = Path(os.environ["PIPEJOB_HEAP_ASK"])
    threading.Thread(target=_serve, args=(_ask,), daemon=True).start()
"""


def snapshot(ask: Path, out: Path, timeout: float = 300) -> tracemalloc.Snapshot:
    ask.write_text(str(out))
    deadline = time.monotonic() + timeout
    while not out.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the operator wrote no heap snapshot")
        time.sleep(0.2)
    return tracemalloc.Snapshot.load(str(out))


def run_jobs(c: Cluster, watch: PodWatch, names: list[str], timeout: float) -> None:
    """Make the jobs `names` (both kinds in turn) and wait until every one is Running."""
    for i, name in enumerate(names):
        jobs.create(c.api, manifest(name, ("2", "hybrid")[i % 2]), NAMESPACE)
    deadline = time.monotonic() + timeout
    while not all(n in watch.jobs_seen.running for n in names):
        watch.jobs_seen.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every job Running after {timeout:g}s")
        time.sleep(0.5)


def report(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, jobs: int, top: int):
    heap = [sum(s.size for s in snap.statistics("filename")) for snap in (before, after)]
    say(
        f"  Python heap {heap[0] / 2**20:.1f} -> {heap[1] / 2**20:.1f} MB:"
        f" {(heap[1] - heap[0]) / jobs / 1024:.1f} kB per job"
    )
    say(f"\nwhere it grew, per job (of {jobs} more), by file:")
    for stat in after.compare_to(before, "filename")[:top]:
        say(
            f"  {stat.size_diff / jobs:8.0f} B  {stat.count_diff / jobs:6.1f} blocks  "
            f"{stat.traceback[0].filename.split('site-packages/')[-1]}"
        )
    say("\nby the allocating line and its callers:")
    for stat in after.compare_to(before, "traceback")[:top]:
        say(f"  {stat.size_diff / jobs:8.0f} B  {stat.count_diff / jobs:6.1f} blocks")
        for frame in list(stat.traceback)[-6:]:
            say(f"      {frame.filename.split('site-packages/')[-1]}:{frame.lineno}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=300, help="jobs in each of the two batches")
    ap.add_argument("--frames", type=int, default=8, help="tracemalloc's frames kept")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--resync", type=float, default=10.0, help="PIPEJOB_RESYNC_SECONDS")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    harness.cluster.ApiServer = LeanApiServer
    say(f"operator_heap: 2 x {args.jobs} jobs kept; {machine()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="pipejob-opheap-") as tmp, Cluster(Path(tmp)) as c:
        tmp_path = Path(tmp)
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        ask = tmp_path / "ask"
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        os.environ |= {"PIPEJOB_HEAP_ASK": str(ask), "PIPEJOB_HEAP_FRAMES": str(args.frames)}
        for path in sorted((REPO / "crds").glob("*.yaml")):
            jobs.apply_crd(c.api, yaml.safe_load(path.read_text()))
        operator = Operator(c.kubeconfig, tmp_path / "operator.log", "warning", args.resync)
        job_watch = JobWatch(c.api)
        watch = PodWatch(c.api, job_watch)
        try:
            operator.wait_healthy()
            snaps, rss = [], []
            for batch in range(2):
                started = time.monotonic()
                names = [f"h{batch}-{i}" for i in range(args.jobs)]
                run_jobs(c, watch, names, args.timeout)
                time.sleep(2 * args.resync)  # a resync or two over all of them
                snaps.append(snapshot(ask, tmp_path / f"heap{batch}"))
                rss.append(operator.memory()[0])
                say(
                    f"  {args.jobs * (batch + 1)} jobs Running: RSS {rss[-1]:.1f} MB"
                    f" ({time.monotonic() - started:.0f} s; {load_average()})",
                    flush=True,
                )
        finally:
            watch.close()
            job_watch.close()
            operator.stop()
    say(f"  RSS per job: {(rss[1] - rss[0]) * 1024 / args.jobs:.1f} kB")
    report(snaps[0], snaps[1], args.jobs, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
