"""The reference points of `compare.py` that are not RPC pipelines:

- `pipelining`: torch.distributed.pipelining with ScheduleGPipe and Schedule1F1B, two processes
  over gloo, each holding one half of ResNet-50 cut where the tutorial cuts it
  (conv1 .. layer2 | layer3 .. fc), SGD on each stage's own parameters;
- `single`: the whole ResNet-50 in one process (threads from OMP_NUM_THREADS).

Same batch, image size, loss (MSE against one-hot labels, as the tutorial) and optimizer
(SGD, lr 0.05) as the baseline. Rank 0 (or the single process) prints `@@mark` lines around the
measured batches of each configuration and one `@@result` line per configuration.

    python benchmarks/references.py single --batch 48 --image 64
    python benchmarks/references.py pipelining --rank R --port P --micro-batches 2,4"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _common import one_hot, result, timed_batches, tutorial_split
from torch import nn

NUM_CLASSES = 1000
SCHEDULES = ("gpipe", "1f1b")


def run_single(args: argparse.Namespace) -> None:
    first, second = tutorial_split(NUM_CLASSES)
    model = nn.Sequential(first, second)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    labels, loss_fn = one_hot(args.batch, NUM_CLASSES), nn.MSELoss()

    def step(inputs: torch.Tensor) -> None:
        opt.zero_grad()
        loss_fn(model(inputs), labels).backward()
        opt.step()

    name = f"single-t{torch.get_num_threads()}"
    seconds = timed_batches(step, name, args.batch, args.image, args.warmup, args.batches)
    result(
        {
            "system": name,
            "m": 1,
            "threads": torch.get_num_threads(),
            "batch_seconds": seconds,
            "samples_per_second": args.batch * len(seconds) / sum(seconds),
        }
    )


def run_pipelining(args: argparse.Namespace) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2
    )
    torch.manual_seed(0)
    shard = tutorial_split(NUM_CLASSES)[args.rank]
    opt = torch.optim.SGD(shard.parameters(), lr=0.05)
    labels, loss_fn = one_hot(args.batch, NUM_CLASSES), nn.MSELoss()
    last = args.rank == 1
    for schedule_name in args.schedules.split(","):
        for m in (int(m) for m in args.micro_batches.split(",")):
            if schedule_name == "1f1b" and m < 2:
                continue  # Schedule1F1B needs at least as many micro-batches as stages
            stage = PipelineStage(shard, args.rank, 2, torch.device("cpu"))
            schedule = classes[schedule_name](stage, n_microbatches=m, loss_fn=loss_fn)

            def step(inputs: torch.Tensor, schedule=schedule) -> None:
                opt.zero_grad()
                if last:
                    schedule.step(target=labels, losses=[])
                else:
                    schedule.step(inputs)
                opt.step()

            name = f"{schedule_name}-m{m}"
            if args.rank == 0:
                seconds = timed_batches(
                    step, name, args.batch, args.image, args.warmup, args.batches
                )
                rate = args.batch * len(seconds) / sum(seconds)
                result(
                    {
                        "system": schedule_name,
                        "m": m,
                        "batch_seconds": seconds,
                        "samples_per_second": rate,
                    }
                )
            else:
                for _ in range(args.warmup + args.batches):
                    step(torch.randn(args.batch, 3, args.image, args.image))
            dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("single", "pipelining"))
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--micro-batches", default="1,2,4,8")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batches", type=int, default=4)
    args = ap.parse_args()
    if args.what == "single":
        run_single(args)
    else:
        run_pipelining(args)


if __name__ == "__main__":
    main()
