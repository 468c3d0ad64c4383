"""How fast the operator turns custom resources into pods, on the emulated cluster.

The unmodified operator (`pipejob operator`, a process) against the tests' API server emulator
(tests/harness: kmock plus apiserver semantics) on loopback. No kubelet runs the pods: a
stand-in node marks each pod Running as soon as it is seen, with a podIP where one stand-in
master answers every /progress poll as a master past its own check (phase preflight), so jobs
reach their Running phase. With no gang scheduler the operator makes a PipelineJob's master
pod first and its stage pods once a poll of that master finds it checked (core/master_first.py;
such a master is polled 0.2 s after it runs, ahead of the routine polls: poll_schedule.py).
Measured from the moment the benchmark
POSTs a job to the moment a watch on pods has seen:

- "the operator's own": a PipelineJob's master pod, every pod of a HybridJob: what the operator
  makes at once, with nothing outside it to wait for (the targets are its);
- "PipelineJob all pods": its stage pods too; this adds the wait for the first poll of its
  master (0.2 s), which a real master's own check would add to anyway.

- `--scale` jobs of both kinds (2-stage PipelineJobs and HybridJobs in turn) created at
  `--rate` per second and all kept: the p50 and p99 of each figure above, the time until
  every job is Running, the operator's peak memory (VmHWM), its API requests per job and the
  master's /progress polls per job (every running master is polled, at most
  PIPEJOB_POLL_BUDGET polls a second in all; a poll whose report is unchanged makes no API
  request);
- then, beside them, one job at a time, for PipelineJobs of 2, 8 and 32 stages (pipejob's
  transformer, one block per stage) and a HybridJob (2 trainers, 1 parameter server): p50
  and p99 of both figures (each job is deleted, and its pods garbage-collected, before the
  next).

A job the operator refuses (phase Failed) ends the run at once, saying which and why (exit 2).
Targets (the operator's own): issue 6, a 2-stage p50 < 0.5 s; issue 60, at 5,000 jobs p50
< 0.5 s and the operator < 300 MB. It measures and prints; it asserts nothing.

    python benchmarks/operator_scale.py                      # 30 jobs per size, 100 kept
    python benchmarks/operator_scale.py --jobs 0 --scale 5000 --rate 50
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import yaml
from _cluster import NAMESPACE, LeanApiServer, Operator
from _common import REPO, counters, load_average, machine, spread

sys.path.insert(0, str(REPO / "tests"))
from _scale_watch import JobWatch, PodWatch, Refused, stand_in_master

import harness.cluster  # the tests' harness lives in tests/
from harness import jobs
from harness.client import Api
from harness.cluster import Cluster
from pipejob.core.spec import InvalidSpec, parse
from pipejob.operator import kube


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


OWN, PIPE_ALL = "the operator's own", "PipelineJob all pods"
FIGURES = (OWN, "PipelineJob master", PIPE_ALL, "HybridJob all pods")


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


def one_at_a_time(
    api: Api, watch: PodWatch, shape: str, count: int, timeout: float
) -> tuple[list[float], list[float]]:
    """Each job's seconds to the operator's own pods (a PipelineJob's master, a HybridJob's
    every pod), and to all its pods."""
    own, every = [], []
    for i in range(count):
        name = f"s{shape}-{i}"
        made = manifest(name, shape)
        start = time.perf_counter()
        jobs.create(api, made, NAMESPACE)
        master, last = watch.wait_all(pod_names(name, shape), timeout)
        own.append((last if shape == "hybrid" else master) - start)
        every.append(last - start)
        api.delete(jobs.resource(made["kind"]), name, NAMESPACE)
    return own, every


def p50_p99(values: list[float]) -> str:
    return f"p50 {spread(values)[1]:.3f}s p99 {percentile(values, 0.99):.3f}s"


def _seen(
    watch: PodWatch, posts: list[Future], names: list[str], timeout: float
) -> tuple[float, float]:
    """When the first of `names` and the last were seen; on a timeout, a POST's failure, if
    one failed (it says more than the pods that never came)."""
    try:
        return watch.wait_all(names, timeout)
    except TimeoutError:
        failed = [p.exception() for p in posts if p.done() and p.exception()]
        if failed:
            raise failed[0] from None
        raise


def at_scale(
    api: Api, watch: PodWatch, count: int, rate: float, timeout: float, tick=None
) -> tuple[dict[str, list[float]], float]:
    """`count` jobs, 2-stage PipelineJobs and HybridJobs in turn, created at `rate` per second
    (4 clients) and kept: their creation-to-pods times by FIGURES, and the time until all run.
    `tick(figures, seconds)` is called at each tenth of the jobs whose pods were seen."""
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
        each: dict[str, list[float]] = {what: [] for what in FIGURES}
        for k, (name, shape) in enumerate(shapes.items(), 1):
            first, last = _seen(watch, posts, pod_names(name, shape), timeout)
            master, last = first - created[name], last - created[name]
            kind = "HybridJob" if shape == "hybrid" else "PipelineJob"
            each[OWN].append(last if kind == "HybridJob" else master)
            each[f"{kind} all pods"].append(last)
            if kind == "PipelineJob":
                each["PipelineJob master"].append(master)
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
        f" makes a queue, which the p50 then measures); creation to the operator's own pods"
        f" {p50_p99(each[OWN])}, to a PipelineJob's all {p50_p99(each[PIPE_ALL])}"
    )
    deadline = time.monotonic() + timeout
    while len([n for n in shapes if n in watch.jobs_seen.running]) < count:
        watch.jobs_seen.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every job Running after {timeout:g}s")
        time.sleep(0.2)
    return each, max(watch.jobs_seen.running[n] for n in shapes) - start


def measure(args: argparse.Namespace, c: Cluster, operator: Operator, watch: PodWatch) -> list:
    """The kept jobs first, then one job at a time of each shape beside them (`beside`)."""
    rows = []
    if args.scale:
        cpu, asked = operator.cpu_seconds(), LeanApiServer.operator_requests
        calls, (ours, emulator) = Counter(LeanApiServer.by_call), own_cpu_seconds()
        polls = watch.master.polls

        def tick(each: dict[str, list[float]], seconds: float) -> None:
            rss, peak = operator.memory()
            say(
                f"    {len(each[OWN])} jobs' pods after {seconds:.0f}s (to the operator's own"
                f" {p50_p99(each[OWN])}, a PipelineJob's all {p50_p99(each[PIPE_ALL])}"
                f" so far): operator"
                f" {operator.cpu_seconds() - cpu:.0f} CPU-s, RSS {rss:.0f} MB (peak {peak:.0f});"
                f" emulator {own_cpu_seconds()[1] - emulator:.0f} CPU-s; {load_average()}"
            )

        each, running = at_scale(c.api, watch, args.scale, args.rate, args.timeout, tick)
        cpu, asked = operator.cpu_seconds() - cpu, LeanApiServer.operator_requests - asked
        now = own_cpu_seconds()
        calls, ours, emulator = LeanApiServer.by_call - calls, now[0] - ours, now[1] - emulator
        rss, peak = operator.memory()
        polls = (watch.master.polls - polls) / args.scale
        for what in FIGURES:
            rows.append((f"{args.scale} kept: {what}", spread(each[what])[1], each[what]))
        say(
            f"  {args.scale} jobs at {args.rate:g}/s: "
            + "; ".join(f"{what} {p50_p99(each[what])}" for what in FIGURES)
            + f"; all Running after {running:.1f}s; operator"
            f" {cpu:.1f} CPU-s ({cpu / args.scale * 1000:.0f} CPU-ms/job),"
            f" {asked / args.scale:.1f} API requests/job, {polls:.1f} /progress polls/job,"
            f" RSS {rss:.0f} MB (peak {peak:.0f} MB);"
            f" the emulated API server {emulator:.1f} CPU-s ({emulator / cpu:.1f}x the"
            f" operator's), this process in all (with the stand-in node and the watches)"
            f" {ours:.1f} CPU-s; {load_average()}"
        )
        say(
            "  the operator's requests per job: "
            + ", ".join(f"{name} {n / args.scale:.1f}" for name, n in calls.most_common(12))
        )
    return rows + beside(args, c, operator, watch)


def beside(args: argparse.Namespace, c: Cluster, operator: Operator, watch: PodWatch) -> list:
    """One job at a time of each shape, beside the kept ones: the summary's rows."""
    rows = []
    for shape in [s for s in args.sizes.split(",") if s] if args.jobs else []:
        cpu, emulator = operator.cpu_seconds(), own_cpu_seconds()[1]
        own, every = one_at_a_time(c.api, watch, shape, args.jobs, args.timeout)
        cpu = (operator.cpu_seconds() - cpu) / args.jobs
        emulator = (own_cpu_seconds()[1] - emulator) / args.jobs
        rss, _ = operator.memory()
        what = (
            "HybridJob (4 pods)" if shape == "hybrid" else f"{shape}-stage ({int(shape) + 1} pods)"
        )
        rows.append((f"{what}: {OWN}", spread(own)[1], own))
        if shape != "hybrid":
            rows.append((f"{what}: all pods", spread(every)[1], every))
        say(
            f"  {what} x{args.jobs} beside {args.scale} kept: the operator's own"
            f" {p50_p99(own)} (max {max(own):.3f})"
            + (f", all pods {p50_p99(every)}" if shape != "hybrid" else "")
            + f"; operator"
            f" {cpu * 1000:.0f} CPU-ms/job, RSS {rss:.0f} MB; the emulated API server"
            f" {emulator * 1000:.0f} CPU-ms/job; {load_average()}"
        )
    return rows


def summary(rows: list, peak: float) -> None:
    """The figures against their targets."""
    say("\ncreation to pods, p50 / p99 (targets, the operator's own: p50 < 0.5 s):")
    for what, mid, values in rows:  # the targets are a 2-stage job's and the kept jobs'
        aimed = what.endswith(OWN) and (what.startswith("2-stage") or "kept" in what)
        target = ("met" if mid < 0.5 else "missed") if aimed else ""
        say(f"  {what:<44} {mid:6.3f} s / {percentile(values, 0.99):6.3f} s   {target}")
    say(f"  operator peak RSS {peak:.0f} MB   target < 300 MB: {'met' if peak < 300 else 'missed'}")
    say(f"  ({load_average()})")


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
        master = stand_in_master()
        watch = PodWatch(c.api, job_watch, master)
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
            master.close()
            operator.stop()
            if args.keep_log:
                shutil.copy(Path(tmp) / "operator.log", args.keep_log)
    summary(rows, peak)
    return 0


if __name__ == "__main__":
    sys.exit(main())
