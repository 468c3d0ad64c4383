"""A chaos run: the unmodified operator (`pipejob operator`, a process) on the emulated cluster
the tests use (tests/harness), under faults drawn from a seed, with invariants checked all
along and at the end (issue 60).

Stand-in nodes run no trainer: they bind each pod and mark it Running, end a deleted pod's
graceful deletion a moment later, and a world's master stands in for its trainer: it steps at
its job's pace from the newest checkpoint on the job's checkpoint volume (as its pod mounts
it), writes one every checkpoint.everySteps steps, and exits 0 at the last step
(benchmarks/_chaos_node.py). Over `--minutes` the faults come: the API server
answering the operator 500, 429 (Retry-After), 409 to updates or 410 Gone to watches, or
slowly; the operator SIGKILLed and restarted; a member killed (exit 137), OOM-killed, or
frozen (its watchdog's verdict: exit 6, "stalled: ..."); a node lost (its pods marked
disrupted and deleted); jobs of both kinds created, resized, suspended, resumed and deleted.
Then the faults stop, every suspended job resumes, and every job not deleted must finish
within `--settle` seconds. Checked: never two live pods of one rank of a world; nothing left
behind a deleted job; status never going backwards; status.restarts counting member
failures only; no world resuming more than its checkpoint interval behind the furthest step
of its job (benchmarks/_chaos_checks.py).

    python benchmarks/chaos.py --seed 1 --jobs 50 --minutes 10

prints the faults and each invariant's verdict (and, for a job counted wrong, what befell it);
exits 1 on a violation. The seed fixes the schedule (benchmarks/_chaos_schedule.py); which pod
or job a fault hits depends on what the cluster holds at its moment (the operator's timing
varies)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import yaml
from _chaos_checks import (
    Check,
    StatusHistory,
    WorkKept,
    all_finished,
    counted_right,
    left_behind,
)
from _chaos_checks import one_pod_per_rank as check_ranks
from _chaos_node import NODES, Node, ended, node_of
from _chaos_schedule import Fault, Schedule
from _cluster import NAMESPACE, LeanApiServer, Operator
from _common import REPO

sys.path.insert(0, str(REPO / "tests"))
import harness.cluster  # the tests' harness lives in tests/
from harness import jobs
from harness.client import Api, ApiError
from harness.cluster import Cluster
from pipejob.core.contract import STALLED_PREFIX, ExitCode
from pipejob.core.kinds import KINDS

LEFT = ("v1/pods", "v1/services", "networking.k8s.io/v1/networkpolicies")


say = functools.partial(print, flush=True)


def manifest(name: str, kind: str, rng: random.Random) -> dict:
    # The checkpoints on a disk of the job's own, which every world of it mounts.
    disk = {"name": "checkpoints", "persistentVolumeClaim": {"claimName": f"{name}-checkpoints"}}
    checkpoint = {"path": "/checkpoints", "volume": "checkpoints"}
    common = {
        "steps": rng.randint(10, 40),
        "checkpoint": checkpoint | {"everySteps": rng.choice((2, 3, 5))},
        "backoffLimit": 20,
        "template": {"resources": {"limits": {"memory": "1Gi"}}, "volumes": [disk]},
        "oom": {"maxMemory": "8Gi"},
    }
    if kind == "HybridJob":
        spec = {"trainers": rng.choice((1, 2)), "parameterServers": 1}
    else:
        model = {"vocabSize": 64, "layers": 4, "width": 16, "heads": 2, "seqLen": 8}
        spec = {"model": {"transformer": model}, "stages": rng.choice((2, 3))}
    meta = {"name": name}
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": kind,
        "metadata": meta,
        "spec": common | spec,
    }


class Statuses:
    """Every job status a watch delivers, fed to the history check; the latest by job."""

    def __init__(self, api: Api):
        self.history = StatusHistory()
        self.latest: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.watches = [api.watch(jobs.resource(kind), NAMESPACE) for kind in KINDS]
        for watch in self.watches:
            threading.Thread(target=self._run, args=(watch,), daemon=True).start()

    def _run(self, watch) -> None:
        for event in watch:
            obj = event["object"]
            if event["type"] == "DELETED" or "status" not in obj:
                continue
            with self.lock:
                self.history.see(obj["metadata"]["name"], obj["status"])
                self.latest[obj["metadata"]["name"]] = obj["status"]


class Chaos:
    """The run: its cluster, operator, node, the jobs it made, and the faults by job."""

    def __init__(self, args: argparse.Namespace, c: Cluster, tmp: Path):
        self.args, self.c, self.tmp = args, c, tmp
        # The seed fixes the schedule: when each job comes and what it is, when each fault
        # comes, its kind, and its own draws (how long, which job, pod or node), so that one
        # fault finding more or fewer candidates shifts no other (Schedule). `rng`: the draws
        # of the fault being injected.
        self.schedule = Schedule(args)
        self.rng = random.Random()
        self.pace: dict[str, float] = {}  # seconds a step, by job
        self.work = WorkKept()
        self.node = Node(c.api, self.pace, self.work)
        self.statuses = Statuses(c.api)
        self.kinds: dict[str, str] = {}
        self.deleted: set[str] = set()
        self.suspended: set[str] = set()
        self.faults: dict[str, Counter] = defaultdict(Counter)
        self.injected: Counter = Counter()
        self.skipped = 0  # faults of the schedule that found nothing to act on
        self.trail: dict[str, list[str]] = defaultdict(list)  # what befell each job, when
        self.ranks = Check("never two live pods of one rank of a world")
        self.crashes = Check("the operator never exits by itself")
        self.operator = self._operator()

    def _operator(self) -> Operator:
        return Operator(self.c.kubeconfig, self.tmp / "operator.log", "info", self.args.resync)

    def create(self, i: int) -> None:
        name, kind = f"chaos-{i}", ("PipelineJob", "HybridJob")[i % 2]
        self.kinds[name] = kind
        draws = self.schedule.job_draws[i]
        job = manifest(name, kind, draws)
        self.pace[name] = draws.uniform(3, self.args.train) / job["spec"]["steps"]
        jobs.create(self.c.api, job, NAMESPACE)

    def live_jobs(self) -> list[str]:
        return sorted(set(self.kinds) - self.deleted)

    # --- the faults: each returns what it did, or None when it found nothing to do it to --

    def api(self, code: int) -> str:
        seconds = self.rng.uniform(2, 6)
        self.c.faults.fail_for(seconds, code=code, share=0.5)
        return f"API server answers half the operator's requests {code} for {seconds:.1f}s"

    def slow(self) -> str:
        seconds, delay = self.rng.uniform(3, 8), self.rng.uniform(0.3, 1.5)
        self.c.faults.fail_for(seconds, code=0, delay=delay)
        return f"API server answers the operator {delay:.1f}s late for {seconds:.1f}s"

    def operator_kill(self) -> str:
        self.operator.kill()
        time.sleep(self.rng.uniform(0, 2))
        self.operator = self._operator()
        return "operator SIGKILLed and restarted"

    def _running_pod(self) -> tuple[str, str] | None:
        pods = [
            (name, p["metadata"]["labels"]["pipejob.dev/job"])
            for name, p in sorted(self.node.snapshot().items())
            if (p.get("status") or {}).get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")
        ]
        return self.rng.choice(pods) if pods else None

    def member(self, how: str) -> str | None:
        found = self._running_pod()
        if found is None:
            return None
        name, job = found
        if how == "killed":
            status, cause = ended(137, "Error"), "member"
        elif how == "OOM-killed":
            status, cause = ended(137, "OOMKilled"), "oom"
        else:  # frozen: the master's watchdog names it and exits 6
            why = f"{STALLED_PREFIX} {name} stopped answering: no heartbeat for 61 s"
            status, cause = ended(ExitCode.STALLED, "Error", why), "member"
            name = f"{job}-master-0"
        if not self.node.set_status(name, status):
            return None
        self.faults[job][cause] += 1
        return f"pod {name} {how}"

    def node_lost(self) -> str | None:
        """A node lost with the pods it ran: each marked disrupted, then deleted, the very one
        on it (by its uid: a pod of that name made meanwhile is another node's)."""
        k = self.rng.randrange(NODES)
        gone = [
            (name, p)
            for name, p in sorted(self.node.snapshot().items())
            if node_of(name) == f"node-{k}"
        ]
        disrupted = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "DeletionByTaintManager",
        }
        for name, pod in gone:
            job = pod["metadata"]["labels"]["pipejob.dev/job"]
            if self.node.set_status(name, {"conditions": [disrupted]}):
                self.faults[job]["node"] += 1
                self.faults[job]["member"] += 1  # a pod deleted while it runs is a failure too
            elif _oom_killed(pod):  # its OOM kill, deleted before the operator saw it, is
                self.faults[job]["member"] += 1  # a plain failure to it: a pod deleted
        time.sleep(0.5)
        for name, pod in gone:
            # No kubelet there to end it: forced, as the pod garbage collector does.
            only = {"gracePeriodSeconds": 0, "preconditions": {"uid": pod["metadata"]["uid"]}}
            with contextlib.suppress(ApiError):
                self.c.api.delete("v1/pods", name, NAMESPACE, only)
        names = ", ".join(name for name, _ in gone)
        return f"node {k} lost with its pods {names}" if gone else None

    def edit(self, what: str) -> str | None:
        candidates = [j for j in self.live_jobs() if (what == "resumed") == (j in self.suspended)]
        unfinished = [j for j in candidates if self.phase(j) not in ("Succeeded", "Failed")]
        if not unfinished:
            return None
        job = self.rng.choice(unfinished)
        resource = jobs.resource(self.kinds[job])
        if what == "deleted":
            self.c.api.delete(resource, job, NAMESPACE)
            self.deleted.add(job)
            return f"job {job} deleted"
        if what == "resized":
            field = "trainers" if self.kinds[job] == "HybridJob" else "stages"
            spec = {
                field: self.rng.choice((1, 2)) if field == "trainers" else self.rng.choice((2, 3))
            }
        else:
            spec = {"suspend": what == "suspended"}
            (self.suspended.add if what == "suspended" else self.suspended.discard)(job)
        self.c.api.patch(resource, job, {"spec": spec}, NAMESPACE)
        return f"job {job} {what} ({spec})"

    def phase(self, job: str) -> str | None:
        with self.statuses.lock:
            return (self.statuses.latest.get(job) or {}).get("phase")

    def inject(self, fault: Fault) -> None:
        """Inject `fault` with its own draws; one that finds nothing to act on is skipped."""
        self.rng = fault.draws()
        kinds = {
            "api-500": lambda: self.api(500),
            "api-429": lambda: self.api(429),
            "api-409": lambda: self.api(409),
            "api-410": lambda: self.api(410),
            "slow-api": self.slow,
            "operator-kill": self.operator_kill,
            "member-kill": lambda: self.member("killed"),
            "member-oom": lambda: self.member("OOM-killed"),
            "member-freeze": lambda: self.member("frozen"),
            "node-lost": self.node_lost,
            "job-resize": lambda: self.edit("resized"),
            "job-suspend": lambda: self.edit("suspended"),
            "job-resume": lambda: self.edit("resumed"),
            "job-delete": lambda: self.edit("deleted"),
        }
        done = kinds[fault.kind]()
        if done is None:
            self.skipped += 1
            return
        self.injected[fault.kind] += 1
        said = f"{time.monotonic() - self.start:7.1f}s {fault.kind}: {done}"
        for job in set(re.findall(r"chaos-\d+", done)):
            self.trail[job].append(said)
        if self.args.verbose:
            say(f"  {said}")

    # --- the run -------------------------------------------------------------------------

    def run(self) -> None:
        self.start = time.monotonic()
        window = self.args.minutes * 60
        born, faults = self.schedule.born, self.schedule.faults
        made = drawn = 0
        while (now := time.monotonic() - self.start) < window:
            while made < len(born) and born[made] <= now:
                self.create(made)
                made += 1
            while drawn < len(faults) and faults[drawn].at <= now:
                self.inject(faults[drawn])
                drawn += 1
            self.step()
        self.c.faults.until = 0.0  # the faults stop; every suspended job resumes
        for job in sorted(self.suspended - self.deleted):
            self.c.api.patch(
                jobs.resource(self.kinds[job]), job, {"spec": {"suspend": False}}, NAMESPACE
            )
        self.suspended.clear()

    def step(self) -> None:
        if self.operator.process.poll() is not None:  # its Deployment would restart it
            self.crashes.fail(f"exited {self.operator.process.returncode} by itself")
            self.operator = self._operator()
        self.node.tick(time.monotonic())
        check_ranks(list(self.node.snapshot().values()), self.ranks)
        time.sleep(0.2)

    def settle(self) -> float:
        """Until every job not deleted has finished, at most --settle seconds: how long."""
        start = time.monotonic()
        while time.monotonic() - start < self.args.settle:
            with self.statuses.lock:
                phases = {
                    j: (self.statuses.latest.get(j) or {}).get("phase") for j in self.live_jobs()
                }
            if all(p in ("Succeeded", "Failed") for p in phases.values()):
                break
            self.step()
        return time.monotonic() - start

    def verdicts(self, settled: float) -> list[Check]:
        time.sleep(2)  # the garbage collector and the last watch events
        gone = Check("nothing left behind a deleted job")
        left_behind(self.deleted, {r: self.c.api.list(r, NAMESPACE) for r in LEFT}, gone)
        counts = Check("status.restarts counts member failures only")
        finished = Check(
            f"every job not deleted finished within {self.args.settle:g}s of the faults"
        )
        with self.statuses.lock:
            latest = {j: s for j, s in self.statuses.latest.items() if j not in self.deleted}
        counted_right(latest, self.faults, counts)
        for job in sorted(j for j in latest if any(j + ":" in v for v in counts.violations)):
            said = {k: latest[job].get(k) for k in ("restarts", "preemptions", "oomKills")}
            say(f"{job}: {said} after {dict(self.faults[job])}: " + "; ".join(self.trail[job]))
        phases = all_finished(
            {j: latest.get(j, {}) for j in self.live_jobs()}, self.deleted, finished
        )
        say(f"after the faults: {phases} in {settled:.0f}s; {len(self.deleted)} jobs deleted")
        self.crashes.checked = self.ranks.checked
        history = self.statuses.history.check
        return [self.ranks, gone, history, counts, finished, self.work.check, self.crashes]


def _oom_killed(pod: dict) -> bool:
    """Whether the pod's trainer was killed for memory (as the run's member-oom ends it)."""
    states = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return (states[0].get("state") or {}).get("terminated", {}).get("reason") == "OOMKilled"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=50, help="jobs made over the run, both kinds")
    ap.add_argument("--minutes", type=float, default=10, help="how long the faults come")
    ap.add_argument("--gap", type=float, default=3, help="mean seconds between faults")
    ap.add_argument("--train", type=float, default=30, help="most seconds a world trains")
    ap.add_argument("--settle", type=float, default=180, help="bound after the faults stop")
    ap.add_argument("--resync", type=float, default=5, help="PIPEJOB_RESYNC_SECONDS")
    ap.add_argument("--verbose", action="store_true", help="print each fault as it comes")
    ap.add_argument("--keep-log", type=Path, help="copy the operator's log here")
    args = ap.parse_args(argv)
    harness.cluster.ApiServer = LeanApiServer
    say(f"chaos: seed {args.seed}, {args.jobs} jobs, {args.minutes:g} min of faults")
    with tempfile.TemporaryDirectory(prefix="pipejob-chaos-") as tmp, Cluster(Path(tmp)) as c:
        for path in sorted((REPO / "crds").glob("*.yaml")):
            jobs.apply_crd(c.api, yaml.safe_load(path.read_text()))
        c.faults.rng.seed(args.seed)
        chaos = Chaos(args, c, Path(tmp))
        try:
            chaos.operator.wait_healthy()
            chaos.run()
            checks = chaos.verdicts(chaos.settle())
        finally:
            chaos.operator.stop()
            if args.keep_log:
                shutil.copy(Path(tmp) / "operator.log", args.keep_log)
    say(
        f"faults injected ({sum(chaos.injected.values())}, {chaos.skipped} more found nothing"
        " to act on): " + ", ".join(f"{k} x{n}" for k, n in sorted(chaos.injected.items()))
    )
    for check in checks:
        say(f"  {check.name}: {check.verdict()}")
    broken = [c for c in checks if c.violations]
    say("chaos: " + (f"{len(broken)} invariant(s) violated" if broken else "every invariant held"))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
