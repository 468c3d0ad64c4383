"""The schedule of a chaos run (benchmarks/chaos.py), drawn whole from its seed before the run
starts: when each job comes and its own draws (its shape and pace), and when each fault comes,
its kind and its own draws (how long, which job, pod or node). Drawn up front, the schedule is
the same for one seed however the run goes: a fault that finds more or fewer candidates than
last time (the operator's timing varies) takes its pick from its own draws and shifts no other.
What each fault hits still depends on what the cluster holds at its moment."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

FAULT_KINDS = (
    "api-409",
    "api-410",
    "api-429",
    "api-500",
    "job-delete",
    "job-resize",
    "job-resume",
    "job-suspend",
    "member-freeze",
    "member-kill",
    "member-oom",
    "node-lost",
    "operator-kill",
    "slow-api",
)


@dataclass(frozen=True)
class Fault:
    """One fault of the schedule: seconds into the run, its kind, and the seed of its draws."""

    at: float
    kind: str
    seed: int

    def draws(self) -> random.Random:
        return random.Random(self.seed)


class Schedule:
    """The jobs (`born`: seconds into the run, the first at 0; `job_draws`: each job's own
    draws) and the faults (in time order) of a run of `args` (--seed, --jobs, --minutes,
    --gap: the mean seconds between faults)."""

    def __init__(self, args: argparse.Namespace):
        window = args.minutes * 60
        jobs, faults = random.Random(f"jobs {args.seed}"), random.Random(f"faults {args.seed}")
        born = sorted(jobs.uniform(0, 0.7 * window) for _ in range(args.jobs - 1))
        self.born = [0.0, *born][: args.jobs]
        self.job_draws = [random.Random(jobs.getrandbits(64)) for _ in self.born]
        self.faults: list[Fault] = []
        at = faults.expovariate(1 / args.gap)
        while at < window:
            self.faults.append(Fault(at, faults.choice(FAULT_KINDS), faults.getrandbits(64)))
            at += faults.expovariate(1 / args.gap)
