"""Pipeline replicas: what a second copy of the pipeline costs, in one run.

The same PipelineJob (2 stages, `--batch` samples per replica per step) with 1 and with 2
replicas through `pipejob run`, interleaved `--repeats` times. For each it prints samples/s,
samples per CPU-second of the whole world (master and stages, read from /proc between the
master's step lines after the warm-up) and, with 2 replicas, the seconds per step the stages
spend averaging their gradients (the all-reduce, waiting for the other replica included).

On one machine the replicas share its cores, so wall-clock scaling cannot show here: the
ratio that can is samples per CPU-second (target: 2 replicas at least 0.9x of one). It
measures; it asserts nothing.

    python benchmarks/replicas.py              # about 5 minutes on 2 idle cores
    python benchmarks/replicas.py --quick      # one repeat of 2 measured steps
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _common import load_average, machine, run_job, spread


def manifest(args: argparse.Namespace, replicas: int) -> dict:
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": f"replicas-{replicas}"},
        "spec": {
            "model": args.model,
            "stages": 2,
            "replicas": replicas,
            "microBatches": 2,
            "batchSize": args.batch,
            "imageSize": args.image,
            "numClasses": 100,
            "steps": args.warmup + args.steps,
            "logEvery": 1,
            "seed": 0,
            "optimizer": {"name": "sgd", "lr": 0.01},
            "preflight": {"enabled": False},
        },
    }


def run(args: argparse.Namespace, tmp: Path, replicas: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    summary, wall, deltas = run_job(
        manifest(args, replicas),
        tmp / f"r{replicas}",
        replicas,
        args.warmup + args.steps,
        args.warmup,
        args.timeout,
        env,
    )
    cpu = sum(d.cpu for name, d in deltas.items() if name != "runner")
    samples = args.batch * replicas * args.steps
    return {
        "samplesPerSecond": samples / wall,
        "samplesPerCpuSecond": samples / cpu,
        "cpuSecondsPerStep": cpu / args.steps,
        "allreduceSecondsPerStep": summary.get("allreduceSecondsPerStep", 0.0),
        "divergence": summary.get("replicaDivergence", 0.0),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=16, help="samples per replica per step")
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--quick", action="store_true", help="one repeat of 2 measured steps")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, 2
    print(
        f"replicas: {args.model}, 2 stages, {args.batch} samples per replica per step,"
        f" {args.image}x{args.image}, {args.repeats} repeat(s) of {args.steps} measured steps;"
        f" {machine()}, {load_average()}",
        flush=True,
    )
    results: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for replicas in (1, 2):  # interleaved: drift in the load hits both alike
                results[replicas].append(run(args, Path(tmp), replicas))
                r = results[replicas][-1]
                print(
                    f"  repeat {repeat + 1}: {replicas} replica(s):"
                    f" {r['samplesPerSecond']:.1f} samples/s,"
                    f" {r['samplesPerCpuSecond']:.2f} samples/CPU-s, all-reduce"
                    f" {r['allreduceSecondsPerStep']:.3f} s/step ({load_average()})",
                    flush=True,
                )
    header = ("replicas", "samples/s", "samples/CPU-s", "all-reduce s/step")
    print("\n" + f"{header[0]:>8} " + " ".join(f"{h:>20}" for h in header[1:]))
    for replicas, rs in results.items():
        keys = ("samplesPerSecond", "samplesPerCpuSecond", "allreduceSecondsPerStep")
        cells = [spread([r[k] for r in rs]) for k in keys]
        row = " ".join(f"{m:>8.3f} [{lo:.2f}-{hi:.2f}]" for lo, m, hi in cells)
        print(f"{replicas:>8} {row}")
    ratio = statistics.median(r["samplesPerCpuSecond"] for r in results[2]) / statistics.median(
        r["samplesPerCpuSecond"] for r in results[1]
    )
    worst = max(r["divergence"] for r in results[2])
    print(
        f"\n2 replicas / 1: {ratio:.2f}x the samples per CPU-second (target >= 0.9);"
        f" replicas differed by at most {worst:.3g}"
    )
    print("(the largest difference between the replicas' parameter fingerprints)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
