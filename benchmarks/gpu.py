"""pipejob's pipelines against one process doing the same work on the same GPU (issue 22).

For each workload: one process trains the model (pipejob's own build of it, the same data
feed, loss and SGD) on the device and reports samples/s; then `pipejob run` trains it in 2
and 4 stages (`gpusPerStage: 1`: on a one-GPU machine the stages share it, as the local
runner allows for pipeline stages) and the master's summary gives samples/s. Printed: each,
and pipejob's ratio to one process. Two stages sharing one GPU do the same work as one
process, so about 1.0x is the limit; what is missing is per-micro-batch overhead.

    python benchmarks/gpu.py                      # on a CUDA machine: the issue's table
    python benchmarks/gpu.py --device cpu --small # the same comparison on CPU, tiny (a smoke run)

torch.distributed.pipelining's 1F1B on the same work is not run here (benchmarks/compare.py
measures it on CPU against the tutorial's ResNet-50 split)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import machine, run_job

WORKLOADS = {  # name -> (model, spec fields)
    "resnet50-224": ({"torchvision": "resnet50"},
                     {"imageSize": 224, "batchSize": 256, "microBatches": 8}),
    "resnet50-64": ({"torchvision": "resnet50"},
                    {"imageSize": 64, "batchSize": 256, "microBatches": 8}),
    "transformer-12x768": ({"transformer": {"vocabSize": 256, "layers": 12, "width": 768,
                                            "heads": 12, "seqLen": 256}},
                           {"batchSize": 32, "microBatches": 4}),
}  # fmt: skip
SMALL = {
    "resnet18-32": ({"torchvision": "resnet18"},
                    {"imageSize": 32, "batchSize": 8, "microBatches": 2}),
    "transformer-2x64": ({"transformer": {"vocabSize": 64, "layers": 2, "width": 64,
                                          "heads": 4, "seqLen": 16}},
                         {"batchSize": 8, "microBatches": 2}),
}  # fmt: skip


def manifest(name: str, model: dict[str, Any], fields: dict[str, Any], stages: int,
             steps: int, gpus: int) -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": f"gpu-{name}-{stages}".replace(".", "-")},
        "spec": {"model": model, "stages": stages, "steps": steps, "logEvery": 1,
                 "gpusPerStage": gpus, "seed": 0, "optimizer": {"name": "sgd", "lr": 0.01},
                 "preflight": {"enabled": False}, **fields},
    }  # fmt: skip


def one_process(job: dict[str, Any], device: str, steps: int, warmup: int) -> float:
    """Samples/s of the whole model in this process on `device`: pipejob's model, data feed
    and loss, SGD, `steps` steps of which the first `warmup` are left out."""
    import torch

    from pipejob.core.spec import parse
    from pipejob.trainer import workloads
    from pipejob.trainer.workloads import data, models

    spec = parse(job).settings
    model = models.build(spec).to(device)
    loss_fn = workloads.loss(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with data.Feed(spec) as feed:
        batches = [feed.batch() for _ in range(steps)]
    start = 0.0
    for step, (x, y) in enumerate(batches):
        if step == warmup:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return spec.batch_size * (steps - warmup) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny workloads (a smoke run)")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu.py: no CUDA GPU here, so nothing is measured; --device cpu runs the same"
              " comparison on the CPU")  # fmt: skip
        return 0
    gpus = 1 if args.device == "cuda" else 0
    where = torch.cuda.get_device_name(0) if gpus else f"CPU ({machine()})"
    print(f"pipejob against one process on {where}, torch {torch.__version__}, float32")
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipejob-gpu-") as tmp:
        for name, (model, fields) in (SMALL if args.small else WORKLOADS).items():
            job = manifest(name, model, fields, 2, args.steps, gpus)
            alone = one_process(job, args.device, args.steps, args.warmup)
            row = [name, f"{alone:.1f}"]
            print(f"  {name}: one process {alone:.1f} samples/s", flush=True)
            for stages in map(int, args.stages.split(",")):
                job = manifest(name, model, fields, stages, args.steps, gpus)
                summary, _, _ = run_job(job, Path(tmp) / f"{name}-{stages}", f"{name}{stages}",
                                        args.steps, args.warmup, args.timeout,
                                        dict(os.environ))  # fmt: skip
                rate = summary["samplesPerSecond"]
                print(f"  {name}: pipejob {stages} stages {rate:.1f} samples/s"
                      f" ({rate / alone:.2f}x)", flush=True)  # fmt: skip
                row.append(f"{rate:.1f} ({rate / alone:.2f}x)")
            rows.append(row)
    head = ["workload", "one process", *(f"pipejob {s} stages" for s in args.stages.split(","))]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
