"""How fast the operator turns custom resources into pods, on the emulated cluster.

The unmodified operator (`pipejob operator`, a process) against the tests' API server emulator
(tests/harness: kmock plus apiserver semantics) on loopback. No kubelet: pods need not run,
only exist. Measured from the moment the benchmark POSTs a PipelineJob to the moment a watch on
pods has seen every pod of its world:

- one job at a time, for 2-, 8- and 32-stage jobs: p50 and p99 (each job is deleted, and its
  pods garbage-collected, before the next);
- 100 two-stage jobs (3 pods each) created at once: time until all 300 pods exist;
- the operator's resident memory (VmRSS now, VmHWM its peak) after each phase.

Targets of issue 6: p50 < 0.5 s for a 2-stage job; 100 jobs converge < 10 s; RSS < 150 MB.
It measures and prints; it asserts nothing.

    python benchmarks/operator_scale.py                  # 30 jobs per size
    python benchmarks/operator_scale.py --jobs 10 --burst 100 --log-level debug
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from _common import REPO, free_port, load_average, machine, spread

sys.path.insert(0, str(REPO / "tests"))
import harness.cluster  # noqa: E402  (the tests' harness lives in tests/)
from harness import jobs  # noqa: E402
from harness.apiserver import ApiServer  # noqa: E402
from harness.client import Api  # noqa: E402
from harness.cluster import Cluster  # noqa: E402

NAMESPACE = "default"
PIPEJOB = Path(sys.executable).parent / "pipejob"


class LeanApiServer(ApiServer):
    """The harness's API server without kmock's request log. kmock keeps every request for
    test assertions and matches each new one against all of them (its `_handle` walks the
    log), so its cost per request grows with the requests served: at a few thousand requests
    the emulator, not the operator, sets the pace. A benchmark of the operator needs no log."""

    async def _handle(self, request):
        self._requests[:] = [request]  # the one being served must stay matchable
        return await super()._handle(request)


def say(message: str) -> None:
    print(message, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


class PodWatch:
    """Records when each pod is first seen by a watch, and wakes waiters."""

    def __init__(self, api: Api):
        self.seen: dict[str, float] = {}
        self.changed = threading.Condition()
        self.watch = api.watch("v1/pods", NAMESPACE)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for event in self.watch:
            if event.get("type") == "ADDED":
                name = event["object"]["metadata"]["name"]
                with self.changed:
                    self.seen.setdefault(name, time.perf_counter())
                    self.changed.notify_all()

    def wait_all(self, names: list[str], timeout: float) -> float:
        """When the last of `names` was first seen."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not all(n in self.seen for n in names):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [n for n in names if n not in self.seen]
                    raise TimeoutError(f"pods never appeared: {', '.join(missing[:5])} ...")
                self.changed.wait(left)
            return max(self.seen[n] for n in names)

    def close(self) -> None:
        self.watch.close()


class Operator:
    """`pipejob operator` as a process against the emulator, with production-like settings."""

    def __init__(self, kubeconfig: Path, log: Path, log_level: str, resync: float):
        self.port = free_port()
        argv = [
            str(PIPEJOB),
            "operator",
            "-n",
            NAMESPACE,
            "--log-level",
            log_level,
            "--health-host",
            "127.0.0.1",
            "--health-port",
            str(self.port),
        ]
        if (
            "--metrics-port"
            in subprocess.run(
                [str(PIPEJOB), "operator", "--help"], capture_output=True, text=True
            ).stdout
        ):
            argv += ["--metrics-host", "127.0.0.1", "--metrics-port", str(free_port())]
        guard = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
        env = os.environ | {"KUBECONFIG": str(kubeconfig), "PIPEJOB_RESYNC_SECONDS": str(resync)}
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [*guard, *argv],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_healthy(self, timeout: float = 60) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "the operator did not come up:\n" + self.log.read_text()[-3000:]
                    ) from None
                time.sleep(0.2)

    def memory(self) -> tuple[float, float]:
        """(VmRSS, VmHWM) in MB."""
        fields = {}
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
        return fields["VmRSS"], fields["VmHWM"]

    def cpu_seconds(self) -> float:
        f = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def manifest(name: str, stages: int) -> dict:
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": name},
        "spec": {"model": "resnet18", "stages": stages, "steps": 3},
    }


def pod_names(name: str, stages: int) -> list[str]:
    return [f"{name}-master-0"] + [f"{name}-stage-{i}" for i in range(stages)]


def one_at_a_time(
    api: Api, watch: PodWatch, stages: int, count: int, timeout: float
) -> list[float]:
    latencies = []
    for i in range(count):
        name = f"s{stages}-{i}"
        start = time.perf_counter()
        jobs.create(api, manifest(name, stages), NAMESPACE)
        latencies.append(watch.wait_all(pod_names(name, stages), timeout) - start)
        api.delete(jobs.resource("PipelineJob"), name, NAMESPACE)
    return latencies


def burst(api: Api, watch: PodWatch, count: int, timeout: float) -> tuple[float, list[float]]:
    """Create `count` 2-stage jobs at once (8 clients); time until all their pods exist, and
    each job's own latency."""
    names = [f"burst-{i}" for i in range(count)]
    created: dict[str, float] = {}

    def create(name: str) -> None:
        created[name] = time.perf_counter()
        jobs.create(api, manifest(name, 2), NAMESPACE)

    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, names))
    posted = time.perf_counter() - start
    last = watch.wait_all([p for n in names for p in pod_names(n, 2)], timeout)
    each = [watch.wait_all(pod_names(n, 2), 0.1) - created[n] for n in names]
    say(f"  posted {count} jobs in {posted:.2f}s")
    return last - start, each


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=30, help="jobs per size, one at a time")
    ap.add_argument("--sizes", default="2,8,32", help="stages per job")
    ap.add_argument("--burst", type=int, default=100, help="2-stage jobs created at once")
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
    sizes = [int(s) for s in args.sizes.split(",")]
    emulator = "with kmock's request log" if args.kmock_request_log else "request log off"
    say(
        f"operator_scale: {machine()}; operator log level {args.log_level}, resync"
        f" {args.resync:g}s; emulator {emulator}; {time.strftime('%Y-%m-%d %H:%M')}"
    )
    with tempfile.TemporaryDirectory(prefix="pipejob-opscale-") as tmp, Cluster(Path(tmp)) as c:
        for path in sorted((REPO / "crds").glob("*.yaml")):
            jobs.apply_crd(c.api, yaml.safe_load(path.read_text()))
        operator = Operator(c.kubeconfig, Path(tmp) / "operator.log", args.log_level, args.resync)
        watch = PodWatch(c.api)
        try:
            operator.wait_healthy()
            rss, _ = operator.memory()
            say(f"operator up: RSS {rss:.0f} MB")
            rows = []
            for stages in sizes:
                cpu = operator.cpu_seconds()
                lat = one_at_a_time(c.api, watch, stages, args.jobs, args.timeout)
                cpu = (operator.cpu_seconds() - cpu) / args.jobs
                rss, peak = operator.memory()
                lo, mid, hi = spread(lat)
                rows.append((stages, mid, percentile(lat, 0.99), lo, hi, cpu))
                say(
                    f"  {stages:>2}-stage ({stages + 1} pods) x{args.jobs}: p50 {mid:.3f}s"
                    f" p99 {percentile(lat, 0.99):.3f}s (min {lo:.3f}, max {hi:.3f});"
                    f" operator {cpu * 1000:.0f} CPU-ms/job, RSS {rss:.0f} MB; {load_average()}"
                )
            cpu, own = operator.cpu_seconds(), time.process_time()
            converge, each = burst(c.api, watch, args.burst, args.timeout)
            cpu, own = operator.cpu_seconds() - cpu, time.process_time() - own
            say(f"  burst CPU: operator {cpu:.1f}s, API server emulator (this process) {own:.1f}s")
            rss, peak = operator.memory()
            say(
                f"  burst of {args.burst}: all {3 * args.burst} pods after {converge:.2f}s;"
                f" per job p50 {spread(each)[1]:.2f}s p99 {percentile(each, 0.99):.2f}s;"
                f" RSS {rss:.0f} MB (peak {peak:.0f} MB); {load_average()}"
            )
        finally:
            watch.close()
            operator.stop()
            if args.keep_log:
                shutil.copy(Path(tmp) / "operator.log", args.keep_log)
    say("\nagainst the targets of issue 6:")
    two = next((r for r in rows if r[0] == 2), None)
    if two:
        say(
            f"  CR -> all pods, 2-stage p50  {two[1]:6.3f} s   target < 0.5 s:"
            f" {'met' if two[1] < 0.5 else 'missed'}"
        )
    for stages, mid, p99, *_ in rows:
        say(f"  {stages:>2}-stage: p50 {mid:.3f} s, p99 {p99:.3f} s")
    say(
        f"  {args.burst} jobs x 3 pods converge {converge:6.2f} s   target < 10 s:"
        f" {'met' if converge < 10 else 'missed'}"
    )
    say(
        f"  operator RSS peak          {peak:6.0f} MB  target < 150 MB:"
        f" {'met' if peak < 150 else 'missed'}"
    )
    say(f"  ({load_average()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
