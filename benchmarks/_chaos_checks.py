"""The invariants benchmarks/chaos.py holds the operator to, each a small checker fed what the
run observes (every job status a watch delivers, the pods as they stand, the faults it
injected) that keeps its violations, for the verdict. Pure: no cluster here, so each can be
shown to fail (tests/test_operator_chaos.py)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

FINISHED = ("Succeeded", "Failed")
# Counters of the status that only grow.
COUNTS = ("restarts", "preemptions", "resizes", "oomKills", "observedGeneration")
JOB_LABEL, ROLE_LABEL, INDEX_LABEL = "pipejob.dev/job", "pipejob.dev/role", "pipejob.dev/index"
REPLICA_LABEL = "pipejob.dev/replica"


@dataclass
class Check:
    """One invariant: its name, how often it was checked, and what broke it (at most 20 kept)."""

    name: str
    checked: int = 0
    violations: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        if len(self.violations) < 20:
            self.violations.append(what)

    def verdict(self) -> str:
        if self.violations:
            return f"VIOLATED ({len(self.violations)}): " + "; ".join(self.violations[:5])
        return f"held ({self.checked} checks)"


class StatusHistory:
    """Status never goes backwards: its counters never shrink, and a finished job stays
    finished (the run edits no finished job)."""

    def __init__(self) -> None:
        self.check = Check("status never goes backwards")
        self.last: dict[str, dict] = {}

    def see(self, job: str, status: dict) -> None:
        self.check.checked += 1
        old = self.last.get(job)
        self.last[job] = status
        if old is None:
            return
        for count in COUNTS:
            if int(status.get(count) or 0) < int(old.get(count) or 0):
                self.check.fail(f"{job}: {count} {old.get(count)} -> {status.get(count)}")
        if old.get("phase") in FINISHED and status.get("phase") != old.get("phase"):
            self.check.fail(f"{job}: {old.get('phase')} -> {status.get('phase')}")


def one_pod_per_rank(pods: list[dict], check: Check) -> None:
    """Never two live pods (not deleted, not finished) of one rank of one job's world."""
    check.checked += 1
    ranks = Counter()
    for pod in pods:
        meta = pod["metadata"]
        phase = (pod.get("status") or {}).get("phase")
        if meta.get("deletionTimestamp") or phase in FINISHED:
            continue
        labels = meta.get("labels") or {}
        keys = (JOB_LABEL, ROLE_LABEL, INDEX_LABEL, REPLICA_LABEL)
        ranks[tuple(labels.get(k) for k in keys)] += 1
    for rank, n in ranks.items():
        if n > 1:
            check.fail(f"{n} live pods of job {rank[0]} role {rank[1]} index {rank[2]}")


def left_behind(deleted: set[str], objects: dict[str, list[dict]], check: Check) -> None:
    """Nothing of a deleted job remains: `objects` by kind, each labelled with its job."""
    check.checked += 1
    for kind, items in objects.items():
        for obj in items:
            job = (obj["metadata"].get("labels") or {}).get(JOB_LABEL)
            if job in deleted:
                check.fail(f"{kind} {obj['metadata']['name']} of deleted job {job}")


def counted_right(statuses: dict[str, dict], faults: dict[str, Counter], check: Check) -> None:
    """status.restarts counts member failures only, and each other count its own cause: no
    more restarts than members killed or frozen, preemptions than nodes lost under it, OOM
    restarts than OOM kills, whatever the API server and the operator went through."""
    causes = {"restarts": "member", "preemptions": "node", "oomKills": "oom"}
    for job, status in statuses.items():
        check.checked += 1
        for count, cause in causes.items():
            if int(status.get(count) or 0) > faults[job][cause]:
                check.fail(
                    f"{job}: {count} {status.get(count)} > {faults[job][cause]} {cause} faults"
                )


class WorkKept:
    """No world resumes more than its job's checkpoint interval behind the furthest step an
    earlier world of the job reached. A trainer resumes from the newest checkpoint where its
    pods mount checkpoint.path: a world the operator makes without the job's checkpoint volume
    (or a trainer that writes its checkpoints late) starts further back."""

    def __init__(self) -> None:
        self.check = Check("a resumed job loses at most its checkpoint interval")
        self.reached: dict[str, int] = {}

    def step(self, job: str, step: int) -> None:
        self.reached[job] = max(step, self.reached.get(job, 0))

    def resumed(self, job: str, step: int, every: int) -> None:
        """A world of `job` started from checkpoint `step` (0: none), checkpointing every
        `every` steps."""
        self.check.checked += 1
        lost = self.reached.get(job, 0) - step
        if lost > every:
            self.check.fail(
                f"{job} resumed from step {step} after step {self.reached[job]}:"
                f" {lost} steps lost, checkpoints every {every}"
            )


def all_finished(statuses: dict[str, dict], deleted: set[str], check: Check) -> dict[str, int]:
    """Every job not deleted has finished; returns the phases' counts."""
    phases: dict[str, int] = defaultdict(int)
    for job, status in statuses.items():
        if job in deleted:
            continue
        check.checked += 1
        phase = status.get("phase") or "none"
        phases[phase] += 1
        if phase not in FINISHED:
            check.fail(f"{job} still {phase}")
    return dict(phases)
