"""Record what `microBatches: auto` decides from, and what it should decide: for a 2-stage
PipelineJob, each cut candidate's cost at every candidate micro-batch count, measured as the
master measures them (balance.measure_costs, with the stage processes' intra-op threads,
which pipejob's tuning derives from this process's CPU affinity), and each count's samples/s
measured through `pipejob run` (interleaved repeats, rate from the master's summary).

The file it writes is what tests/test_auto_ranking.py checks the predictor against: run it
again on another machine or core count (e.g. `taskset -c 0-15`) to add a recording there.

    python benchmarks/auto_costs.py --out tests/data/auto-costs-2cores.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import load_average, machine, run_job

UNSET = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")  # set here for measuring


def manifest(model: str, batch: int, image: int, m: int, steps: int) -> dict[str, Any]:
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": f"auto-costs-m{m}"},
        "spec": {
            "model": model,
            "engine": "rpc",  # the engine of the recordings (tests/data/auto-costs-*.json)
            "stages": 2,
            "microBatches": m,
            "batchSize": batch,
            "imageSize": image,
            "numClasses": 10,
            "steps": steps,
            "logEvery": 1,
            "optimizer": {"name": "sgd", "lr": 0.05},
            "seed": 0,
        },
    }


def measure_costs(job: dict[str, Any], counts: list[int]) -> tuple[int, dict[int, Any]]:
    """The stages' thread count and, per count, each unit's (seconds, CPU seconds)."""
    import torch

    from pipejob.core import spec, tuning_levers
    from pipejob.trainer.pipeline.balance import intra_op_threads, measure_costs
    from pipejob.trainer.runtime import tuning
    from pipejob.trainer.workloads import cut, data, models

    settings = spec.parse(job).settings
    cpus = tuning.available_cpus()
    threads = tuning.decide(
        "PipelineJob", "stage", 0, cpus, 2, tuning_levers.parse(None), spec=job["spec"]
    ).threads
    torch.manual_seed(0)
    traced = cut.Traced(models.build(settings))
    pieces = traced.split(traced.units[1:])
    inputs = data.sample(settings, settings.batch_size)[0]
    costs = {}
    with intra_op_threads(threads):
        for m in counts:
            c = measure_costs(pieces, traced.units, inputs[: settings.batch_size // m])
            costs[m] = {
                "seconds": [round(x, 6) for x in c.seconds],
                "cpuSeconds": [round(x, 6) for x in c.cpu_seconds],
            }
    return threads or 0, costs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is warm-up)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--where", default="", help="what machine this is, for the record")
    args = ap.parse_args(argv)
    # Measure as the master does: its tuning applied before torch loads (one thread, and
    # OpenMP teams that sleep rather than spin on the cores the stages share), then the
    # stages' thread count while measuring.
    from pipejob.trainer.runtime import tuning

    roles, loopback = ["master", "stage", "stage"], ",".join(["127.0.0.1"] * 3)
    tuning.apply(
        tuning.for_process("PipelineJob", "master", 0, roles, 0, {"PIPEJOB_ADDRESSES": loopback})
    )
    from pipejob.core.kinds.pipeline import micro_batch_counts

    counts = micro_batch_counts(args.batch)
    cores = len(os.sched_getaffinity(0))
    print(
        f"auto_costs: {args.model}, batch {args.batch}, {args.image}px, counts {counts},"
        f" {cores} cores; {machine()}",
        flush=True,
    )
    threads, costs = measure_costs(manifest(args.model, args.batch, args.image, 1, 1), counts)
    print(f"costs measured with {threads} intra-op thread(s) ({load_average()})", flush=True)
    env = {k: v for k, v in os.environ.items() if k not in UNSET}  # the runs' own tuning
    rates: dict[int, list[float]] = {m: [] for m in counts}
    loads = []
    with tempfile.TemporaryDirectory(prefix="pipejob-auto-costs-") as tmp:
        for repeat in range(args.repeats):
            for m in counts:
                job = manifest(args.model, args.batch, args.image, m, args.steps)
                summary, _, _ = run_job(
                    job, Path(tmp) / f"m{m}", m, args.steps, 1, args.timeout, env
                )
                rates[m].append(summary["samplesPerSecond"])
                loads.append(os.getloadavg()[0])
                print(
                    f"  repeat {repeat + 1}: m={m} {rates[m][-1]:.1f} samples/s ({load_average()})",
                    flush=True,
                )
    record = {
        "how": f"benchmarks/auto_costs.py --model {args.model} --batch {args.batch} --image"
        f" {args.image} --steps {args.steps} --repeats {args.repeats}",
        "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "where": args.where,
        "machine": f"{os.cpu_count()} CPUs, {cores} in this affinity; load (1 min) during the"
        f" runs {min(loads):.1f}-{max(loads):.1f}",
        "torch": __import__("torch").__version__,
        "model": args.model,
        "image": args.image,
        "stages": 2,
        "batch": args.batch,
        "cores": cores,
        "threads": threads,
        "counts": counts,
        "costs": {str(m): costs[m] for m in counts},
        "samplesPerSecond": {str(m): rates[m] for m in counts},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    medians = {m: statistics.median(r) for m, r in rates.items()}
    print(f"wrote {args.out}: medians {medians}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
