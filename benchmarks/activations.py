"""How many bytes of activations a stage of the pipelining engine holds for its backwards, as
the micro-batch count grows with the micro-batch size fixed (issue 31): GPipe keeps every
micro-batch's activations until its backward, so its peak grows with microBatches; 1F1B keeps
at most as many micro-batches in flight as there are stages, so its peak stays flat.

Each point is a real job through the local runner (`pipejob run`, engine pipelining, 2 stages
by default, SGD, 2 steps). A stage counts its activations exactly (what autograd saves for its
backwards, parameters left out: pipelining/activations.py) and the summary reports each stage's
peak; the peak resident memory (VmHWM) of each stage process is printed beside it, which also
holds the model, the optimizer and what the allocator keeps.

    python benchmarks/activations.py                          # ResNet-50, m = 4, 8, 16, 32
    python benchmarks/activations.py --model transformer --micro-batch 2
    python benchmarks/activations.py --counts 2,4 --image 32  # a smoke test
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from _common import machine, run_job

MB = 1e6
TRANSFORMER = {"vocabSize": 256, "layers": 4, "width": 256, "heads": 4, "seqLen": 64}


def manifest(args: argparse.Namespace, schedule: str, m: int) -> dict[str, Any]:
    model: Any = {"transformer": TRANSFORMER} if args.model == "transformer" else args.model
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": f"activations-{schedule}-m{m}"},
        "spec": {
            "model": model,
            "engine": "pipelining",
            "schedule": schedule,
            "stages": args.stages,
            "microBatches": m,
            "batchSize": m * args.micro_batch,
            "imageSize": args.image,
            "numClasses": 100,
            "steps": 2,
            "seed": 0,
            "optimizer": {"name": "sgd", "lr": 0.01},
            "preflight": {"enabled": False},
            "rendezvousTimeoutSeconds": 600,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", help="a torchvision name, or transformer")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--counts", default="4,8,16,32", help="micro-batch counts")
    parser.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch")
    parser.add_argument("--image", type=int, default=64)
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = parser.parse_args()
    counts = [int(m) for m in args.counts.split(",")]
    schedules = args.schedules.split(",")
    images = "" if args.model == "transformer" else f", {args.image}x{args.image} images"
    print(
        f"machine: {machine()}; {args.model}, {args.stages} stages, micro-batches of"
        f" {args.micro_batch}{images}"
    )
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pipejob-activations-") as tmp:
        for m in counts:  # interleaved: the machine's drift hits both schedules alike
            for schedule in schedules:
                job = manifest(args, schedule, m)
                summary, _, _ = run_job(
                    job,
                    Path(tmp) / job["metadata"]["name"],
                    m,
                    2,
                    1,
                    args.timeout,
                    dict(os.environ),
                )
                rows[schedule, m] = summary
                held = [st["peakActivationBytes"] / MB for st in summary["partition"]]
                print(
                    f"  {schedule:<6} m={m:<3} activations per stage (MB):"
                    f" {', '.join(f'{h:.1f}' for h in held)}",
                    flush=True,
                )
    stages = [st["stage"] for st in next(iter(rows.values()))["partition"]]
    print(
        f"\npeak activations held for the backward, per stage (MB; peak RSS in brackets),"
        f" micro-batches of {args.micro_batch}:"
    )
    head = f"  {'schedule':<8} {'stage':<7}" + "".join(f" {f'm={m}':>16}" for m in counts)
    print(head)
    for schedule in schedules:
        for k, stage in enumerate(stages):
            cells = ""
            for m in counts:
                summary = rows[schedule, m]
                held = summary["partition"][k]["peakActivationBytes"] / MB
                rss = summary["memory"][stage]["rssPeakBytes"] / MB
                cells += f" {held:>7.1f} [{rss:>5.0f}]"
            print(f"  {schedule:<8} {stage:<7}{cells}")
    for k, stage in enumerate(stages):
        growth = {
            s: rows[s, counts[-1]]["partition"][k]["peakActivationBytes"]
            / rows[s, counts[0]]["partition"][k]["peakActivationBytes"]
            for s in schedules
        }
        said = ", ".join(f"{s} {g:.2f}x" for s, g in growth.items())
        print(
            f"  {stage}: from m={counts[0]} to m={counts[-1]} ({counts[-1] // counts[0]}x the"
            f" micro-batches): {said}"
        )
    print(f"\n{machine()}")


if __name__ == "__main__":
    main()
