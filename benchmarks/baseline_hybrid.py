"""The tutorial's DDP + RPC example (seed 002), written faithfully: the baseline of the HybridJob.

Kept from the tutorial: 4 processes (trainers rank 0 and 1, master rank 2, parameter server
rank 3); the master creates an EmbeddingBag(100, 16, mode="sum") on the ps with `rpc.remote`
and starts each trainer's loop with `rpc_async`; a trainer wraps nn.Linear(16, 8) in DDP
(gloo group of the two trainers, on its own port), looks bags up with
`emb_rref.rpc_sync().forward`, computes CrossEntropyLoss, runs `dist_autograd.backward` and one
`DistributedOptimizer(SGD, lr=0.05)` step over the table's and the dense parameters; batches
are the tutorial's random bags (20-50 ids, bags of 1-10).

What differs: CPU (no `.cuda`); `--iterations` iterations instead of 100 epochs of 10; each
trainer times its loop (and, to show where an iteration goes, the lookup, dense forward +
loss, backward and optimizer step within it), and the master prints `@@mark start/end` around
the loops and an `@@result` line.

    python benchmarks/baseline_hybrid.py --rank R --rpc-port P --ddp-port Q --iterations 300
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.optim as optim
from _common import mark, result
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef, TensorPipeRpcBackendOptions
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16


class HybridModel(torch.nn.Module):
    def __init__(self, emb_rref):
        super().__init__()
        self.emb_rref = emb_rref
        self.fc = DDP(torch.nn.Linear(16, 8))

    def forward(self, indices, offsets):
        emb_lookup = self.emb_rref.rpc_sync().forward(indices, offsets)
        return self.fc(emb_lookup)


def _retrieve_embedding_parameters(emb_rref):
    return [RRef(param) for param in emb_rref.local_value().parameters()]


def get_next_batch():
    while True:
        num_indices = random.randint(20, 50)
        indices = torch.LongTensor(num_indices).random_(0, NUM_EMBEDDINGS)
        offsets, start, batch_size = [], 0, 0
        while start < num_indices:
            offsets.append(start)
            start += random.randint(1, 10)
            batch_size += 1
        yield indices, torch.LongTensor(offsets), torch.LongTensor(batch_size).random_(8)


def _run_trainer(emb_rref, rank, iterations):
    random.seed(rank)
    torch.manual_seed(rank)
    model = HybridModel(emb_rref)
    model_parameter_rrefs = rpc.rpc_sync("ps", _retrieve_embedding_parameters, args=(emb_rref,))
    for param in model.parameters():
        model_parameter_rrefs.append(RRef(param))
    opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    phases = dict.fromkeys(("lookup", "dense", "backward", "step"), 0.0)
    batches = get_next_batch()
    start = time.perf_counter()
    for _ in range(iterations):
        indices, offsets, target = next(batches)
        with dist_autograd.context() as context_id:
            t0 = time.perf_counter()
            emb_lookup = model.emb_rref.rpc_sync().forward(indices, offsets)
            t1 = time.perf_counter()
            loss = criterion(model.fc(emb_lookup), target)
            t2 = time.perf_counter()
            dist_autograd.backward(context_id, [loss])
            t3 = time.perf_counter()
            opt.step(context_id)
            t4 = time.perf_counter()
        for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            phases[name] += seconds
    seconds = time.perf_counter() - start
    return {"iterations": iterations, "seconds": seconds,
            "phases": {k: v / iterations for k, v in phases.items()}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--rpc-port", type=int, required=True)
    ap.add_argument("--ddp-port", type=int, required=True)
    ap.add_argument("--iterations", type=int, default=300)
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.ddp_port))
    options = TensorPipeRpcBackendOptions()
    options.init_method = f"tcp://127.0.0.1:{args.rpc_port}"
    world_size = 4
    if args.rank == 2:
        rpc.init_rpc("master", rank=2, world_size=world_size, rpc_backend_options=options)
        emb_rref = rpc.remote("ps", torch.nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
                              kwargs={"mode": "sum"})  # fmt: skip
        mark("start")
        futs = [rpc.rpc_async(f"trainer{r}", _run_trainer, args=(emb_rref, r, args.iterations))
                for r in (0, 1)]  # fmt: skip
        trainers = [fut.wait() for fut in futs]
        mark("end")
        result({"system": "baseline", "trainers": trainers})
    elif args.rank <= 1:
        dist.init_process_group(backend="gloo", rank=args.rank, world_size=2)
        rpc.init_rpc(f"trainer{args.rank}", rank=args.rank, world_size=world_size,
                     rpc_backend_options=options)  # fmt: skip
    else:
        rpc.init_rpc("ps", rank=args.rank, world_size=world_size, rpc_backend_options=options)
    rpc.shutdown()


if __name__ == "__main__":
    main()
