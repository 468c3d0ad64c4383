"""pipejob's HybridJob against the tutorial's DDP + RPC example (baseline_hybrid.py), in one run:
iterations per second per trainer.

Both run the tutorial's sizes: 2 trainers, EmbeddingBag(100, 16, sum) on a parameter server,
nn.Linear(16, 8) under DDP (gloo), SGD lr 0.05, bags of 1-10 ids and about 6 bags per
iteration (pipejob: batchSize 6, bagSize 10). The baseline steps with a DistributedOptimizer
after the backward: RPCs for the lookup, the backward, the step on the ps and one to itself;
pipejob's ps steps the table during the backward: two RPCs. pipejob runs through the local
runner with its tuning; the baseline with torch's defaults, as the tutorial. Repeats are
interleaved. Besides the rate it prints CPU-seconds per iteration of every process (read from
/proc between the marks around the training loops) and where a baseline iteration goes.
It measures; it asserts nothing.

    python benchmarks/hybrid.py                    # 5 repeats of 1000 iterations (2-3 min)
    python benchmarks/hybrid.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from _common import (
    Counters,
    RunnerWorkers,
    Workers,
    free_port,
    load_average,
    machine,
    python,
    spread,
)

READY_LINE = re.compile(r"^master\s*\| trainers ready")
DONE_LINE = re.compile(r"^master\s*\| done:")


def say(message: str) -> None:
    print(message, flush=True)


class PipejobWorkers(RunnerWorkers):
    def on_line(self, name: str, line: str) -> None:
        if READY_LINE.match(line):
            self.marks["start"] = self.snapshot()
        elif DONE_LINE.match(line):
            self.marks["end"] = self.snapshot()
        super().on_line(name, line)


def manifest(iterations: int) -> dict[str, Any]:
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": "compare-hybrid"},
        "spec": {
            "trainers": 2, "embedding": {"numEmbeddings": 100, "dim": 16, "mode": "sum"},
            "dense": {"outFeatures": 8}, "steps": iterations, "batchSize": 6, "bagSize": 10,
            "datasetSize": 4096, "optimizer": {"name": "sgd", "lr": 0.05},
            "logEvery": max(1, iterations // 5), "seed": 0,
        },
    }  # fmt: skip


def run_pipejob(iterations: int, tmp: Path, extra: dict[str, str], timeout: float) -> dict:
    path, summary_file = tmp / "hybrid.yaml", tmp / "hybrid.json"
    path.write_text(yaml.safe_dump(manifest(iterations)))
    summary_file.unlink(missing_ok=True)
    env = os.environ | extra | {"PIPEJOB_SUMMARY_FILE": str(summary_file)}
    with PipejobWorkers() as w:
        w.start("runner", [sys.executable, "-m", "pipejob.cli", "run", str(path)], env)
        codes = w.wait(timeout)
        if codes["runner"] != 0 or not summary_file.exists():
            raise RuntimeError(f"pipejob HybridJob failed ({codes}):\n{w.tail()}")
        summary = json.loads(summary_file.read_text())
        wall, deltas = w.between("start", "end")
    rates = [t["steps"] / t["seconds"] for t in summary["perTrainer"].values()]
    return {"rates": rates, "wall": wall, "processes": {n: d for n, d in deltas.items()
                                                        if n != "runner"}}  # fmt: skip


def run_baseline(iterations: int, timeout: float) -> dict:
    rpc_port, ddp_port = str(free_port()), str(free_port())
    names = {0: "trainer0", 1: "trainer1", 2: "master", 3: "ps"}
    with Workers() as w:
        for rank in (2, 0, 1, 3):
            w.start(names[rank], python("baseline_hybrid.py", "--rank", str(rank), "--rpc-port",
                                        rpc_port, "--ddp-port", ddp_port, "--iterations",
                                        str(iterations)))  # fmt: skip
        codes = w.wait(timeout, main="master")
        if codes["master"] != 0 or not w.results:
            raise RuntimeError(f"baseline hybrid failed ({codes}):\n{w.tail()}")
        wall, deltas = w.between("start", "end")
    trainers = w.results[0]["trainers"]
    return {"rates": [t["iterations"] / t["seconds"] for t in trainers], "wall": wall,
            "processes": deltas, "phases": [t["phases"] for t in trainers]}  # fmt: skip


def cpu_line(processes: dict[str, Counters], iterations: int) -> str:
    return ", ".join(f"{n} {d.cpu / iterations * 1000:.1f}"
                     for n, d in sorted(processes.items()))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="one repeat of 60 iterations")
    ap.add_argument("--pipejob-env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.iterations = 1, 60
    extra = dict(kv.split("=", 1) for kv in args.pipejob_env)
    say(
        f"hybrid: 2 trainers, EmbeddingBag(100, 16) on a ps, Linear(16, 8) under DDP,"
        f" {args.iterations} iterations x {args.repeats} repeat(s); {machine()};"
        f" {time.strftime('%Y-%m-%d %H:%M')}" + (f"; pipejob env {extra}" if extra else "")
    )
    results: dict[str, list[dict]] = {"pipejob": [], "baseline": []}
    with tempfile.TemporaryDirectory(prefix="pipejob-hybrid-") as tmp:
        for repeat in range(1, args.repeats + 1):
            for system in results:
                t0 = time.monotonic()
                if system == "pipejob":
                    r = run_pipejob(args.iterations, Path(tmp), extra, args.timeout)
                else:
                    r = run_baseline(args.iterations, args.timeout)
                r["load"] = load_average()
                results[system].append(r)
                rates = ", ".join(f"{x:.0f}" for x in r["rates"])
                say(
                    f"  repeat {repeat}: {system:<8} {rates} iterations/s per trainer"
                    f" ({time.monotonic() - t0:.0f}s with start-up; {r['load']})"
                )
    say("\niterations/s per trainer (mean of the trainers): median [min-max] over repeats")
    median = {}
    for system, rs in results.items():
        per_run = [sum(r["rates"]) / len(r["rates"]) for r in rs]
        lo, mid, hi = spread(per_run)
        median[system] = mid
        mid_run = sorted(rs, key=lambda r: sum(r["rates"]))[len(rs) // 2]
        say(f"  {system:<8} {mid:7.1f} [{lo:.1f}-{hi:.1f}]   CPU-ms per iteration:"
            f" {cpu_line(mid_run['processes'], args.iterations)}")  # fmt: skip
    ratio = median["pipejob"] / median["baseline"]
    say(
        f"\n  pipejob / baseline {ratio:.2f}x   target >= 1.2x:"
        f" {'met' if ratio >= 1.2 else 'missed'}"
    )
    phases = [p for r in results["baseline"] for p in r["phases"]]
    say(
        "  where a baseline iteration goes (ms, median over trainers and repeats): "
        + ", ".join(f"{k} {spread([p[k] for p in phases])[1] * 1000:.2f}" for k in phases[0])
    )
    say(f"  ({load_average()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
