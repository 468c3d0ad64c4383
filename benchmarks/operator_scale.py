"""How fast the operator turns custom resources into pods, on the emulated cluster.

The unmodified operator (`pipejob operator`, a process) against the tests' API server emulator
(tests/harness: kmock plus apiserver semantics) on loopback. No kubelet runs the pods: a
stand-in node marks each pod Running as soon as it is seen, so jobs reach their Running phase.
Measured from the moment the benchmark POSTs a job to the moment a watch on pods has seen
every pod of its world:

- `--scale` jobs of both kinds (2-stage PipelineJobs and HybridJobs in turn) created at
  `--rate` per second and all kept: creation-to-pods p50 and p99, the time until every job
  is Running, the operator's peak memory (VmHWM) and its API requests per job;
- then, beside them, one job at a time, for PipelineJobs of 2, 8 and 32 stages (pipejob's
  transformer, one block per stage) and a HybridJob (2 trainers, 1 parameter server): p50
  and p99 (each job is deleted, and its pods garbage-collected, before the next).

A job the operator refuses (phase Failed) ends the run at once, saying which and why (exit 2).
Targets: issue 6, a 2-stage p50 < 0.5 s; issue 60, at 5,000 jobs p50 < 0.5 s and the
operator < 300 MB. It measures and prints; it asserts nothing.

    python benchmarks/operator_scale.py                      # 30 jobs per size, 100 kept
    python benchmarks/operator_scale.py --jobs 0 --scale 5000 --rate 50
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import yaml
from _cluster import NAMESPACE, LeanApiServer, Operator
from _common import REPO, counters, load_average, machine, spread

sys.path.insert(0, str(REPO / "tests"))
import harness.cluster  # noqa: E402  (the tests' harness lives in tests/)
from harness import jobs  # noqa: E402
from harness.client import Api, ApiError  # noqa: E402
from harness.cluster import Cluster  # noqa: E402
from pipejob.core.kinds import KINDS  # noqa: E402
from pipejob.core.spec import InvalidSpec, parse  # noqa: E402
from pipejob.operator import kube  # noqa: E402


class Refused(Exception):
    """The operator failed a job the benchmark made: the run cannot measure what it meant to."""


def own_cpu_seconds() -> tuple[float, float]:
    """CPU seconds of this process (the emulated API server, the stand-in node, the watches),
    and of the emulator's thread alone (LeanApiServer names it)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, counters(os.getpid()).threads.get("apiserver", 0.0)


def say(message: str) -> None:
    print(message, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


RUNNING = {"status": {"phase": "Running"}}


class JobWatch:
    """When each job of both kinds first reached Running, and the first job the operator
    failed (a refusal: InvalidSpec, or any other reason), with its message."""

    def __init__(self, api: Api):
        self.running: dict[str, float] = {}
        self.failed: tuple[str, str] | None = None
        self.watches = [api.watch(jobs.resource(kind), NAMESPACE) for kind in KINDS]
        for watch in self.watches:
            threading.Thread(target=self._run, args=(watch,), daemon=True).start()

    def _run(self, watch) -> None:
        for event in watch:
            obj = event.get("object") or {}
            status, name = obj.get("status") or {}, obj.get("metadata", {}).get("name")
            if status.get("phase") == "Running":
                self.running.setdefault(name, time.perf_counter())
            elif status.get("phase") == "Failed" and self.failed is None:
                why = next(
                    (
                        c.get("message")
                        for c in status.get("conditions") or []
                        if c["type"] == "Failed"
                    ),
                    "",
                )
                self.failed = (f"{obj.get('kind')} {name}", why)

    def check(self) -> None:
        if self.failed is not None:
            raise Refused(f"the operator failed {self.failed[0]}: {self.failed[1]}")

    def close(self) -> None:
        for watch in self.watches:
            watch.close()


class PodWatch:
    """Records when each pod is first seen by a watch, and wakes waiters."""

    def __init__(self, api: Api, jobs_seen: JobWatch):
        self.api, self.jobs_seen = api, jobs_seen
        self.seen: dict[str, float] = {}
        self.changed = threading.Condition()
        self.starting: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.watch = api.watch("v1/pods", NAMESPACE)
        for run in (self._run, self._node):
            threading.Thread(target=run, daemon=True).start()

    def _run(self) -> None:
        for event in self.watch:
            if event.get("type") == "ADDED":
                name = event["object"]["metadata"]["name"]
                with self.changed:
                    self.seen.setdefault(name, time.perf_counter())
                    self.changed.notify_all()
                self.starting.put(name)

    def _node(self) -> None:
        """The stand-in node: each pod seen is reported Running, as a kubelet would."""
        while True:
            name = self.starting.get()
            with contextlib.suppress(ApiError):  # gone already (a deleted job's)
                self.api.patch("v1/pods", name, RUNNING, NAMESPACE, subresource="status")

    def wait_all(self, names: list[str], timeout: float) -> float:
        """When the last of `names` was first seen; Refused as soon as a job failed."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not all(n in self.seen for n in names):
                self.jobs_seen.check()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [n for n in names if n not in self.seen]
                    raise TimeoutError(f"pods never appeared: {', '.join(missing[:5])} ...")
                self.changed.wait(min(left, 0.5))
            return max(self.seen[n] for n in names)

    def close(self) -> None:
        self.watch.close()


def manifest(name: str, shape: str) -> dict:
    """A job of `shape`: "hybrid" (2 trainers, 1 parameter server) or a PipelineJob's stage
    count, on pipejob's transformer cut one block per stage (ResNet-18 has 14 places to cut)."""
    if shape == "hybrid":
        kind, spec = "HybridJob", {"trainers": 2, "parameterServers": 1, "steps": 3}
    else:
        stages = int(shape)
        model = {"vocabSize": 256, "layers": max(2, stages - 1), "width": 32, "heads": 2}
        kind = "PipelineJob"
        spec = {"model": {"transformer": {**model, "seqLen": 16}}, "stages": stages, "steps": 3}
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": spec,
    }


def refusal(shapes: list[str]) -> str | None:
    """Why a job of one of `shapes` would be refused (pipejob's own validation), else None."""
    for shape in shapes:
        try:
            parse(manifest("n", shape), cluster=True)
        except InvalidSpec as e:
            return f"a {shape} job is refused: {'; '.join(map(str, e.errors))}"
    return None


_NAMES: dict[str, list[str]] = {}


def pod_names(name: str, shape: str) -> list[str]:
    """The pods of a `shape` job's first world, as the operator names them."""
    if shape not in _NAMES:
        job = parse(manifest("n", shape), cluster=True)
        _NAMES[shape] = [p["metadata"]["name"][1:] for p in kube.world(job, 0, NAMESPACE)]
    return [name + rest for rest in _NAMES[shape]]


def one_at_a_time(api: Api, watch: PodWatch, shape: str, count: int, timeout: float) -> list[float]:
    latencies = []
    for i in range(count):
        name = f"s{shape}-{i}"
        made = manifest(name, shape)
        start = time.perf_counter()
        jobs.create(api, made, NAMESPACE)
        latencies.append(watch.wait_all(pod_names(name, shape), timeout) - start)
        api.delete(jobs.resource(made["kind"]), name, NAMESPACE)
    return latencies


def _seen(watch: PodWatch, posts: list[Future], names: list[str], timeout: float) -> float:
    """When the last of `names` was seen; on a timeout, a POST's failure, if one failed (it
    says more than the pods that never came)."""
    try:
        return watch.wait_all(names, timeout)
    except TimeoutError:
        failed = [p.exception() for p in posts if p.done() and p.exception()]
        if failed:
            raise failed[0] from None
        raise


def at_scale(
    api: Api, watch: PodWatch, count: int, rate: float, timeout: float, tick=None
) -> tuple[list[float], float]:
    """`count` jobs, 2-stage PipelineJobs and HybridJobs in turn, created at `rate` per second
    (4 clients) and kept: each one's creation-to-pods time, and the time until all run.
    `tick(latencies, seconds)` is called at each tenth of the jobs whose pods were seen."""
    shapes = {f"scale-{i}": ("2", "hybrid")[i % 2] for i in range(count)}
    created: dict[str, float] = {}
    start = time.perf_counter()

    def create(i_name: tuple[int, str]) -> None:
        i, name = i_name
        time.sleep(max(0.0, start + i / rate - time.perf_counter()))
        created[name] = time.perf_counter()
        jobs.create(api, manifest(name, shapes[name]), NAMESPACE)

    # Posted in the background, so that the progress at each tenth is printed as it comes.
    pool = ThreadPoolExecutor(4)
    posts = [pool.submit(create, item) for item in enumerate(shapes)]
    try:
        each = []
        for k, (name, shape) in enumerate(shapes.items(), 1):
            each.append(_seen(watch, posts, pod_names(name, shape), timeout) - created[name])
            if tick is not None and k % max(1, count // 10) == 0:
                tick(each, time.perf_counter() - start)
        for post in posts:
            post.result()
    finally:  # on a refusal or a timeout, the jobs not yet posted are not
        pool.shutdown(wait=False, cancel_futures=True)
    say(f"  posted {count} jobs in {max(created.values()) - start:.1f}s")
    took = time.perf_counter() - start
    say(
        f"  every job's pods after {took:.1f}s ({count / took:.2f} jobs/s against {rate:g}/s"
        f" created; a creation pace above what the operator and the emulator keep up with"
        f" makes a queue, which the p50 then measures); creation-to-pods p50"
        f" {spread(each)[1]:.3f}s p99 {percentile(each, 0.99):.3f}s"
    )
    deadline = time.monotonic() + timeout
    while len([n for n in shapes if n in watch.jobs_seen.running]) < count:
        watch.jobs_seen.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every job Running after {timeout:g}s")
        time.sleep(0.2)
    return each, max(watch.jobs_seen.running[n] for n in shapes) - start


def measure(args: argparse.Namespace, c: Cluster, operator: Operator, watch: PodWatch) -> list:
    """The kept jobs first, then one job at a time of each shape beside them."""
    rows = []
    if args.scale:
        cpu, asked = operator.cpu_seconds(), LeanApiServer.operator_requests
        calls, (ours, emulator) = Counter(LeanApiServer.by_call), own_cpu_seconds()

        def tick(each: list[float], seconds: float) -> None:
            rss, peak = operator.memory()
            say(
                f"    {len(each)} jobs' pods after {seconds:.0f}s (creation-to-pods p50"
                f" {spread(each)[1]:.2f}s p99 {percentile(each, 0.99):.2f}s so far): operator"
                f" {operator.cpu_seconds() - cpu:.0f} CPU-s, RSS {rss:.0f} MB (peak {peak:.0f});"
                f" emulator {own_cpu_seconds()[1] - emulator:.0f} CPU-s; {load_average()}"
            )

        each, running = at_scale(c.api, watch, args.scale, args.rate, args.timeout, tick)
        cpu, asked = operator.cpu_seconds() - cpu, LeanApiServer.operator_requests - asked
        now = own_cpu_seconds()
        calls, ours, emulator = LeanApiServer.by_call - calls, now[0] - ours, now[1] - emulator
        rss, peak = operator.memory()
        rows.append((f"{args.scale} jobs kept", spread(each)[1], percentile(each, 0.99)))
        say(
            f"  {args.scale} jobs at {args.rate:g}/s: creation-to-pods p50 {spread(each)[1]:.3f}s"
            f" p99 {percentile(each, 0.99):.3f}s; all Running after {running:.1f}s; operator"
            f" {cpu:.1f} CPU-s ({cpu / args.scale * 1000:.0f} CPU-ms/job),"
            f" {asked / args.scale:.1f} API requests/job, RSS {rss:.0f} MB (peak {peak:.0f} MB);"
            f" the emulated API server {emulator:.1f} CPU-s ({emulator / cpu:.1f}x the"
            f" operator's), this process in all (with the stand-in node and the watches)"
            f" {ours:.1f} CPU-s; {load_average()}"
        )
        say(
            "  the operator's requests per job: "
            + ", ".join(f"{name} {n / args.scale:.1f}" for name, n in calls.most_common(12))
        )
    for shape in [s for s in args.sizes.split(",") if s] if args.jobs else []:
        cpu, emulator = operator.cpu_seconds(), own_cpu_seconds()[1]
        lat = one_at_a_time(c.api, watch, shape, args.jobs, args.timeout)
        cpu = (operator.cpu_seconds() - cpu) / args.jobs
        emulator = (own_cpu_seconds()[1] - emulator) / args.jobs
        rss, _ = operator.memory()
        lo, mid, hi = spread(lat)
        what = (
            "HybridJob (4 pods)" if shape == "hybrid" else f"{shape}-stage ({int(shape) + 1} pods)"
        )
        rows.append((what, mid, percentile(lat, 0.99)))
        say(
            f"  {what} x{args.jobs} beside {args.scale} kept: p50 {mid:.3f}s p99"
            f" {percentile(lat, 0.99):.3f}s (min {lo:.3f}, max {hi:.3f}); operator"
            f" {cpu * 1000:.0f} CPU-ms/job, RSS {rss:.0f} MB; the emulated API server"
            f" {emulator * 1000:.0f} CPU-ms/job; {load_average()}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=30, help="jobs per size, one at a time")
    ap.add_argument("--sizes", default="2,8,32,hybrid", help="stages per PipelineJob, or hybrid")
    ap.add_argument("--scale", type=int, default=100, help="jobs created and kept (0: none)")
    ap.add_argument("--rate", type=float, default=50, help="jobs created per second at scale")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    ap.add_argument("--resync", type=float, default=10.0, help="PIPEJOB_RESYNC_SECONDS")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--keep-log", type=Path, help="copy the operator's log here")
    ap.add_argument(
        "--kmock-request-log",
        action="store_true",
        help="keep kmock's request log (the harness as the tests use it)",
    )
    args = ap.parse_args(argv)
    if not args.kmock_request_log:
        harness.cluster.ApiServer = LeanApiServer
    shapes = [s for s in args.sizes.split(",") if s and args.jobs] + ["2", "hybrid"] * bool(
        args.scale
    )
    if (why := refusal(shapes)) is not None:
        say(f"operator_scale: stopped before starting: {why}")
        return 2
    emulator = "with kmock's request log" if args.kmock_request_log else "request log off"
    say(
        f"operator_scale: {machine()}; operator log level {args.log_level}, resync"
        f" {args.resync:g}s; emulator {emulator}; {time.strftime('%Y-%m-%d %H:%M')}"
    )
    with tempfile.TemporaryDirectory(prefix="pipejob-opscale-") as tmp, Cluster(Path(tmp)) as c:
        for path in sorted((REPO / "crds").glob("*.yaml")):
            jobs.apply_crd(c.api, yaml.safe_load(path.read_text()))
        operator = Operator(c.kubeconfig, Path(tmp) / "operator.log", args.log_level, args.resync)
        job_watch = JobWatch(c.api)
        watch = PodWatch(c.api, job_watch)
        try:
            operator.wait_healthy()
            say(f"operator up: RSS {operator.memory()[0]:.0f} MB")
            rows = measure(args, c, operator, watch)
            peak = operator.memory()[1]
        except Refused as e:
            say(f"operator_scale: stopped: {e}")
            return 2
        except TimeoutError as e:  # what was measured before it is printed above
            say(f"operator_scale: stopped: {e} (operator RSS peak {operator.memory()[1]:.0f} MB)")
            return 3
        finally:
            watch.close()
            job_watch.close()
            operator.stop()
            if args.keep_log:
                shutil.copy(Path(tmp) / "operator.log", args.keep_log)
    say("\ncreation to all pods, p50 / p99 (targets: p50 < 0.5 s):")
    for what, mid, p99 in rows:  # the targets are a 2-stage job's and the kept jobs'
        aimed = what.startswith("2-stage") or what.endswith("kept")
        target = ("met" if mid < 0.5 else "missed") if aimed else ""
        say(f"  {what:<24} {mid:6.3f} s / {p99:6.3f} s   {target}")
    say(f"  operator peak RSS {peak:.0f} MB   target < 300 MB: {'met' if peak < 300 else 'missed'}")
    say(f"  ({load_average()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
