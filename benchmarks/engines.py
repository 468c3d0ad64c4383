"""A PipelineJob on each engine and schedule, side by side on the same work (issue 31): the
rpc engine at its best micro-batch count, the eager path (spec.model.cut: eager, on the rpc
engine's world) at its best, the pipelining engine with each of its schedules,
and the whole model in one process on every core, for ResNet-50 and pipejob's transformer in
2 and 4 stages.

Every pipejob system is a real job through the local runner (`pipejob run`), its rate the
master's samples/s (the first step, warm-up, left out); the one-process reference runs the
same model, data, loss and optimizer (SGD) in a process of its own with every core's threads.
Every system of a configuration runs once per repeat, repeats interleaved, so drift in the
machine's load hits each alike; each is reported by its median. It measures; it asserts
nothing.

    python benchmarks/engines.py                       # every model and stage count
    python benchmarks/engines.py --models resnet50 --stages 2 --repeats 3
    python benchmarks/engines.py --quick               # a smoke test: tiny sizes, one repeat
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _common import RESULT, fmt_spread, load_average, machine, run_job, spread, thread_env

# The pipelining engine's schedules; the interleaved ones hold STAGES_PER_PROCESS pieces.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
STAGES_PER_PROCESS = 2


def model_spec(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The work: ResNet-50 as compare.py trains it, or the transformer on synthetic tokens."""
    if model == "transformer":
        layers = args.layers
        return {
            "model": {
                "transformer": {
                    "vocabSize": 256,
                    "layers": layers,
                    "width": args.width,
                    "heads": 4,
                    "seqLen": args.seq_len,
                }
            },
            "batchSize": args.batch,
        }
    return {"model": model, "batchSize": args.batch, "imageSize": args.image, "numClasses": 1000}


def manifest(
    args: argparse.Namespace, model: str, stages: int, m: int, engine: dict[str, Any]
) -> dict[str, Any]:
    # A model section among the fields (the eager path's) is named by its cut.
    named = [v.get("cut", "model") if isinstance(v, dict) else v for v in engine.values()]
    name = "-".join(str(v) for v in [model, stages, m, *named])
    pinned = args.split_points.get(model, [])
    # A pinned cut names where each piece begins, so it fits one count only; the eager path
    # places by itself.
    if len(pinned) != stages * engine.get("stagesPerProcess", 1) - 1 or "model" in engine:
        pinned = []
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": name[:40].rstrip("-")},
        "spec": {
            **model_spec(args, model),
            "stages": stages,
            "microBatches": m,
            **engine,
            **({"splitPoints": pinned} if pinned else {}),
            "steps": args.warmup + args.batches,
            "logEvery": 1,
            "seed": 0,
            "optimizer": {"name": "sgd", "lr": 0.05},
            "preflight": {"enabled": False},
            "rendezvousTimeoutSeconds": 600,
        },
    }


def eager(model: str | dict[str, Any]) -> dict[str, Any]:
    """The model's section on the eager path (spec.model.cut: eager)."""
    return {**({"torchvision": model} if isinstance(model, str) else model), "cut": "eager"}


def systems(args: argparse.Namespace, stages: int, model: str) -> dict[str, list[tuple[int, dict]]]:
    """Each system's runs of one repeat: (micro-batch count, engine fields)."""
    out: dict[str, list[tuple[int, dict]]] = {
        "rpc": [(m, {"engine": "rpc"}) for m in args.rpc_counts],
    }
    if args.eager_counts:  # the master runs the forward, the stages the costly modules
        fields = {"engine": "rpc", "model": eager(model_spec(args, model)["model"])}
        out["eager (rpc engine)"] = [(m, fields) for m in args.eager_counts]
    for schedule in args.schedules:
        v = STAGES_PER_PROCESS if schedule in ("interleaved-1f1b", "zero-bubble") else 1
        fields = {"engine": "pipelining", "schedule": schedule, "stagesPerProcess": v}
        # Enough micro-batches for every schedule: at least, and a multiple of, the stages.
        out[f"pipelining {schedule}"] = [(max(args.micro_batches, stages), fields)]
    return out


def one_process(spec_json: str, warmup: int, batches: int) -> None:
    """The reference, in this process: the job's model, data and loss, the whole batch at
    once, SGD; prints its samples/s as a result line."""
    import torch

    from pipejob.core import spec as spec_module
    from pipejob.trainer import workloads
    from pipejob.trainer.workloads import data, models

    job = spec_module.parse(json.loads(spec_json))
    s = job.settings
    model, loss_fn = models.build(s), workloads.loss(s)
    optimizer = torch.optim.SGD(model.parameters(), lr=s.optimizer.lr)
    seconds = []
    with data.Feed(s) as feed:
        for i in range(warmup + batches):
            inputs, labels = feed.batch()
            start = time.perf_counter()
            optimizer.zero_grad()
            loss_fn(model(inputs), labels).backward()
            optimizer.step()
            if i >= warmup:
                seconds.append(time.perf_counter() - start)
    rate = s.batch_size * len(seconds) / sum(seconds)
    print(f"{RESULT}{json.dumps({'samples_per_second': rate})}", flush=True)


def run_one_process(args: argparse.Namespace, job: dict[str, Any]) -> float:
    threads = len(os.sched_getaffinity(0))
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--one-process",
            json.dumps(job),
            "--warmup",
            str(args.warmup),
            "--batches",
            str(args.batches),
        ],
        env=thread_env(threads),
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT)]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the one-process reference failed:\n{out.stdout}{out.stderr}")
    return json.loads(lines[-1][len(RESULT) :])["samples_per_second"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet50,transformer")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--rpc-counts", default="2,4,8", help="the rpc engine's micro-batch counts")
    ap.add_argument("--micro-batches", type=int, default=8, help="the pipelining engine's")
    ap.add_argument("--eager-counts", default="2,4,8", help="the eager path's micro-batch counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batches", type=int, default=4, help="measured steps per run")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8, help="the transformer's")
    ap.add_argument("--width", type=int, default=256, help="the transformer's")
    ap.add_argument("--seq-len", type=int, default=128, help="the transformer's")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument(
        "--split-points",
        action="append",
        default=[],
        metavar="MODEL:P1,P2",
        help="pin a model's cut where the piece count fits (A/B runs of two trees on one cut)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat")
    ap.add_argument("--one-process", help=argparse.SUPPRESS)  # the reference's worker
    args = ap.parse_args()
    if args.one_process:
        one_process(args.one_process, args.warmup, args.batches)
        return
    if args.quick:
        args.repeats, args.batch, args.image, args.batches = 1, 8, 32, 2
        args.layers, args.width, args.seq_len, args.rpc_counts = 6, 32, 16, "2,4"
        args.eager_counts = "2,4"
        args.micro_batches = 4
    args.rpc_counts = [int(m) for m in args.rpc_counts.split(",")]
    args.split_points = {
        model: points.split(",") for model, points in (p.split(":", 1) for p in args.split_points)
    }
    args.eager_counts = [int(m) for m in args.eager_counts.split(",") if m]
    args.schedules = [s for s in args.schedules.split(",") if s]
    configs = [
        (model, int(stages))
        for model in args.models.split(",")
        for stages in args.stages.split(",")
    ]
    print(
        f"engines: {', '.join(f'{m} x {s} stages' for m, s in configs)}; batch {args.batch};"
        f" {args.repeats} repeat(s) of {args.batches} measured steps after {args.warmup};"
        f" {machine()}; {time.strftime('%Y-%m-%d %H:%M')}",
        flush=True,
    )
    rates: dict[tuple[str, int], dict[str, dict[int, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    extras: dict[tuple[str, int, str, int], list[float]] = defaultdict(list)  # bubbles
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pipejob-engines-") as tmp:
        for repeat in range(1, args.repeats + 1):
            for model, stages in configs:
                for system, runs in systems(args, stages, model).items():
                    for m, fields in runs:
                        job = manifest(args, model, stages, m, fields)
                        stem = Path(tmp) / job["metadata"]["name"]
                        summary, _, deltas = run_job(
                            job,
                            stem,
                            m,
                            args.warmup + args.batches,
                            args.warmup,
                            args.timeout,
                            dict(os.environ),
                        )
                        rate = summary["samplesPerSecond"]
                        rates[model, stages][system][m].append(rate)
                        cpu = sum(d.cpu for d in deltas.values())  # every process of the job
                        if "bubble" in summary:  # the eager path does not measure one
                            extras[model, stages, system, m].append(summary["bubble"]["measured"])
                        print(
                            f"[{time.monotonic() - started:5.0f}s] repeat {repeat}: {model}"
                            f" {stages} stages, {system} m={m}: {rate:.1f} samples/s,"
                            f" {args.batch * args.batches / cpu:.1f} per CPU-s ({load_average()})",
                            flush=True,
                        )
                job = manifest(args, model, stages, 1, {})
                rate = run_one_process(args, job)
                rates[model, stages]["one process"][1].append(rate)
                print(
                    f"[{time.monotonic() - started:5.0f}s] repeat {repeat}: {model}, one"
                    f" process on {len(os.sched_getaffinity(0))} threads: {rate:.1f}"
                    f" samples/s ({load_average()})",
                    flush=True,
                )
    print(report(rates, extras))
    print(f"\ntotal {time.monotonic() - started:.0f}s; {machine()}")


def report(
    rates: dict[tuple[str, int], dict[str, dict[int, list[float]]]],
    extras: dict[tuple[str, int, str, int], list[float]],
) -> str:
    """Per configuration: each system at its best count (median [min-max] samples/s), its
    measured bubble, and its rate against the rpc engine's best and against one process."""
    lines = []
    for (model, stages), by in rates.items():
        best = {s: max(counts, key=lambda m, c=counts: spread(c[m])[1]) for s, counts in by.items()}
        median = {s: spread(by[s][m])[1] for s, m in best.items()}
        lines += [
            "",
            f"{model}, {stages} stages: samples/s at each system's best count",
            f"  {'system':<30} {'m':>2} {'samples/s':>20} {'bubble':>6}"
            f" {'/ rpc best':>10} {'/ one process':>13}",
        ]
        for s, m in best.items():
            bubbles = extras.get((model, stages, s, m))
            bubble = f"{spread(bubbles)[1]:>6.0%}" if bubbles else f"{'-':>6}"
            vs_rpc = f"{median[s] / median['rpc']:>9.2f}x" if "rpc" in median else f"{'-':>10}"
            one = median.get("one process")
            vs_one = f"{median[s] / one:>12.2f}x" if one else f"{'-':>13}"
            lines.append(f"  {s:<30} {m:>2} {fmt_spread(by[s][m]):>20} {bubble} {vs_rpc} {vs_one}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
