"""pipejob's pipelines against one process doing the same work on the same GPU (issues 22, 36).

For each workload: one process trains the model (pipejob's own build of it, the same data
feed, loss and SGD) on the device and reports samples/s; then `pipejob run` trains it in 2
and 4 stages (`gpusPerStage: 1`: on a one-GPU machine the stages share it, as the local
runner allows for pipeline stages), with `microBatches: auto` (or the counts --micro-batches
names: the table gives the best), and the master's summary gives samples/s; then
torch.distributed.pipelining's Schedule1F1B does the same work (the same model cut where
pipejob's run cut it, the same batches, micro-batch count (at least one per stage, which
1F1B needs), loss and SGD), one process per stage.
Printed: each, and its ratio to one process. Two stages sharing one GPU do the same work as
one process, so about 1.0x is the limit; what is missing is per-micro-batch overhead.

1F1B runs where it can: its stages talk over NCCL, which refuses two ranks on one GPU, so on
a machine with fewer GPUs than stages it is not run and the table says why (on the CPU it
runs over gloo). So does pipejob's own pipelining engine (spec.engine: pipelining, each
schedule of --schedules, at pipejob's count or one micro-batch per stage, the more): its
stages pass activations over NCCL too. Gloo is no way around it: it sends and receives CPU
tensors only (it takes CUDA tensors for all-reduce and broadcast, not for send and recv), so
stages sharing a GPU would have to stage every activation and gradient through host memory.

    python benchmarks/gpu.py                      # on a CUDA machine: the issue's table
    python benchmarks/gpu.py --device cpu --small # the same comparison on CPU, tiny (a smoke)"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import free_port, machine, run_job

WORKLOADS = {  # name -> (model, spec fields)
    "resnet50-224": ({"torchvision": "resnet50"}, {"imageSize": 224, "batchSize": 256}),
    "resnet50-64": ({"torchvision": "resnet50"}, {"imageSize": 64, "batchSize": 256}),
    "transformer-12x768": (
        {"transformer": {"vocabSize": 256, "layers": 12, "width": 768, "heads": 12, "seqLen": 256}},
        {"batchSize": 32},
    ),
}
SMALL = {
    "resnet18-32": ({"torchvision": "resnet18"}, {"imageSize": 32, "batchSize": 8}),
    "transformer-2x64": (
        {"transformer": {"vocabSize": 64, "layers": 2, "width": 64, "heads": 4, "seqLen": 16}},
        {"batchSize": 8},
    ),
}


def manifest(
    name: str,
    model: dict[str, Any],
    fields: dict[str, Any],
    stages: int,
    steps: int,
    gpus: int,
    m: int | str = 1,
    schedule: str | None = None,
) -> dict[str, Any]:
    """A job of the workload; with `schedule`, on the pipelining engine (the interleaved
    schedules with 2 stages per process)."""
    engine = (
        {"engine": "rpc"}
        if schedule is None
        else {
            "engine": "pipelining",
            "schedule": schedule,
            "stagesPerProcess": 2 if schedule in ("interleaved-1f1b", "zero-bubble") else 1,
        }
    )
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {
            "name": f"gpu-{name}-{stages}-m{m}{'-' + schedule if schedule else ''}".replace(
                ".", "-"
            )
        },
        "spec": {
            "model": model,
            "stages": stages,
            "steps": steps,
            "logEvery": 1,
            "gpusPerStage": gpus,
            "seed": 0,
            "optimizer": {"name": "sgd", "lr": 0.01},
            "preflight": {"enabled": False},
            "microBatches": m,
            **fields,
            **engine,
        },
    }


def pipelining(
    job: dict[str, Any], device: str, runs: Path, steps: int, warmup: int, timeout: float
) -> float | str:
    """Samples/s of `job` on pipejob's pipelining engine; or why it cannot run here."""
    from pipejob.core.kinds.pipeline_schedules import schedule_refuses

    spec = job["spec"]
    if device == "cuda" and torch.cuda.device_count() < spec["stages"]:
        return (
            f"not run: NCCL needs a GPU per stage ({spec['stages']}), this machine has"
            f" {torch.cuda.device_count()}"
        )
    refused = schedule_refuses(spec["schedule"], spec["stages"], spec["microBatches"])
    if refused is not None:
        return f"not run: {refused}"
    try:
        summary, _, _ = run_job(
            job,
            runs / job["metadata"]["name"],
            job["metadata"]["name"],
            steps,
            warmup,
            timeout,
            dict(os.environ),
        )
    except (RuntimeError, TimeoutError) as e:  # the others are still measured
        return f"failed: {str(e).strip().splitlines()[0]}"
    return summary["samplesPerSecond"]


def one_process(job: dict[str, Any], device: str, steps: int, warmup: int) -> float:
    """Samples/s of the whole model in this process on `device`: pipejob's model, data feed
    and loss, SGD, `steps` steps of which the first `warmup` are left out."""
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


def one_f_one_b(
    job: dict[str, Any],
    device: str,
    split_points: list[str],
    steps: int,
    warmup: int,
    timeout: float,
) -> float | str:
    """Samples/s of torch.distributed.pipelining's Schedule1F1B on `job`'s work, cut at
    `split_points`, one process per stage; or why it cannot run here."""
    stages, m = len(split_points) + 1, job["spec"]["microBatches"]
    if m < stages:
        return f"not run: 1F1B needs at least {stages} micro-batches for {stages} stages"
    if device == "cuda" and torch.cuda.device_count() < stages:
        return (
            f"not run: NCCL needs a GPU per stage ({stages}), this machine has"
            f" {torch.cuda.device_count()}"
        )
    with tempfile.TemporaryDirectory(prefix="pipejob-1f1b-") as tmp:
        out = Path(tmp) / "rate"
        context = mp.start_processes(
            _one_f_one_b_rank,
            args=(stages, free_port(), job, device, split_points, steps, warmup, str(out)),
            nprocs=stages,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
                if time.monotonic() > deadline:
                    return f"not run: no result within {timeout:g}s"
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # say why, go on
            return f"failed: {str(e).strip().splitlines()[-1]}"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return float(out.read_text())


def _one_f_one_b_rank(
    rank: int,
    stages: int,
    port: int,
    job: dict[str, Any],
    device: str,
    cut: list[str],
    steps: int,
    warmup: int,
    out: str,
) -> None:
    """Stage `rank` of the 1F1B pipeline: the whole model built as pipejob builds it (under
    the job's seed), its stage cut out of it; the first reads the inputs, the last the labels
    (pipejob's feed), SGD on its own parameters. Rank 0 writes the measured samples/s."""
    import dataclasses

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from pipejob.core.spec import parse
    from pipejob.trainer import workloads
    from pipejob.trainer.pipeline.stage_build import trace
    from pipejob.trainer.workloads import data, models

    spec = dataclasses.replace(parse(job).settings, split_points=cut)
    on = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    if device == "cuda":
        torch.cuda.set_device(on)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=stages,
    )
    try:
        torch.manual_seed(spec.seed)
        shard = trace(spec, models.build(spec)).split(cut)[rank].to(on)
        optimizer = torch.optim.SGD(shard.parameters(), lr=0.01)
        stage = PipelineStage(shard, rank, stages, on)
        schedule = Schedule1F1B(
            stage, n_microbatches=spec.micro_batches, loss_fn=workloads.loss(spec)
        )
        with data.Feed(spec) as feed:
            batches = [feed.batch() for _ in range(steps)]
        start = 0.0
        for step, (x, y) in enumerate(batches):
            if step == warmup:
                if device == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                start = time.perf_counter()
            optimizer.zero_grad()
            if rank == 0:
                schedule.step(x.to(on).contiguous())  # torch 2.11 checks strides
            elif rank == stages - 1:
                schedule.step(target=y.to(on).contiguous())
            else:
                schedule.step()
            optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            rate = spec.batch_size * (steps - warmup) / (time.perf_counter() - start)
            Path(out).write_text(str(rate))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny workloads (a smoke run)")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument(
        "--micro-batches",
        default="auto",
        help="pipejob's microBatches, comma-separated (counts or auto); the table gives the best",
    )
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument(
        "--logs", type=Path, help="keep each pipejob run's manifest, summary and output here"
    )
    ap.add_argument(
        "--schedules",
        default="1f1b",
        help="pipejob's pipelining engine with these schedules, comma-separated"
        " (empty: none): gpipe, 1f1b, interleaved-1f1b, zero-bubble",
    )
    args = ap.parse_args(argv)
    schedules = [s for s in args.schedules.split(",") if s]
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu.py: no CUDA GPU here, so nothing is measured; --device cpu runs the same"
            " comparison on the CPU"
        )
        return 0
    gpus = 1 if args.device == "cuda" else 0
    where = torch.cuda.get_device_name(0) if gpus else f"CPU ({machine()})"
    print(f"pipejob against one process on {where}, torch {torch.__version__}, float32")
    counts = [m if m == "auto" else int(m) for m in args.micro_batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipejob-gpu-") as tmp:
        runs = args.logs or Path(tmp)  # each pipejob run's manifest, summary and output
        runs.mkdir(parents=True, exist_ok=True)
        for name, (model, fields) in (SMALL if args.small else WORKLOADS).items():
            alone = one_process(
                manifest(name, model, fields, 2, args.steps, gpus),
                args.device,
                args.steps,
                args.warmup,
            )
            row = [name, f"{alone:.1f}"]
            print(f"  {name}: one process {alone:.1f} samples/s", flush=True)
            for stages in map(int, args.stages.split(",")):
                best: tuple[float, dict[str, Any]] | None = None
                for m in counts:
                    job = manifest(name, model, fields, stages, args.steps, gpus, m)
                    try:
                        summary, _, _ = run_job(
                            job,
                            runs / job["metadata"]["name"],
                            f"{name}{stages}{m}",
                            args.steps,
                            args.warmup,
                            args.timeout,
                            dict(os.environ),
                        )
                    except (RuntimeError, TimeoutError) as e:  # the others are still measured
                        print(f"  {name}: pipejob {stages} stages, microBatches {m} FAILED: {e}")
                        continue
                    rate = summary["samplesPerSecond"]
                    chose = f", chose {summary['microBatches']}" if m == "auto" else ""
                    print(
                        f"  {name}: pipejob {stages} stages, microBatches {m}{chose}:"
                        f" {rate:.1f} samples/s ({rate / alone:.2f}x)",
                        flush=True,
                    )
                    if best is None or rate > best[0]:
                        best = rate, summary
                if best is None:
                    row += ["failed", "not run", *(["not run"] * len(schedules))]
                    continue
                rate, summary = best
                row.append(f"{rate:.1f} ({rate / alone:.2f}x, m={summary['microBatches']})")
                cut = [st["layers"][0] for st in summary["partition"][1:]]  # where pipejob cut
                # 1F1B needs a micro-batch per stage at least: pipejob's count, or that.
                job = manifest(
                    name,
                    model,
                    fields,
                    stages,
                    args.steps,
                    gpus,
                    max(summary["microBatches"], stages),
                )
                other = one_f_one_b(job, args.device, cut, args.steps, args.warmup, args.timeout)
                said = (
                    other
                    if isinstance(other, str)
                    else (f"{other:.1f} samples/s ({other / alone:.2f}x)")
                )
                print(f"  {name}: 1F1B {stages} stages {said}", flush=True)
                row.append(said.replace(" samples/s", ""))
                for schedule in schedules:  # at the count 1F1B ran
                    job = manifest(
                        name,
                        model,
                        fields,
                        stages,
                        args.steps,
                        gpus,
                        max(summary["microBatches"], stages),
                        schedule,
                    )
                    got = pipelining(job, args.device, runs, args.steps, args.warmup, args.timeout)
                    said = got if isinstance(got, str) else f"{got:.1f} ({got / alone:.2f}x)"
                    print(
                        f"  {name}: pipejob pipelining {schedule} {stages} stages {said}",
                        flush=True,
                    )
                    row.append(said)
            rows.append(row)
    head = [
        "workload",
        "one process",
        *(
            f"{who} {s} stages"
            for s in args.stages.split(",")
            for who in ("pipejob", "1F1B", *(f"pipelining {x}" for x in schedules))
        ),
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print(
        f"pipejob at its best of microBatches {args.micro_batches}; 1F1B at pipejob's count"
        " or one micro-batch per stage, the more:"
    )
    for r in [head, *rows]:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
