"""How fast a tensor crosses between two stage processes over torch.distributed.rpc, as
pipejob's rpc engine sends activations and gradients (issue 36: the GPU pipeline's gap).

Two processes on one machine join a TensorPipe RPC world with the device maps pipejob's
stages use ({0: 0}: cuda:0 to cuda:0, both processes on the same GPU); rank 0 sends rank 1 a
tensor of --megabytes and rank 1 answers with a one-element tensor on the same device.
Printed: the time of one send and its rate, for a CUDA tensor (through CUDA IPC where
TensorPipe's cuda_ipc channel is there, else through host memory) and a CPU tensor, beside a
copy to the host and back inside one process, the cost of going through host memory.

    python benchmarks/rpc_transfer.py              # CUDA and CPU tensors (CPU only without CUDA)
    python benchmarks/rpc_transfer.py --megabytes 8 --rounds 3   # a smoke"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from _common import free_port, machine


def _answer(t: torch.Tensor) -> torch.Tensor:
    # A reply that reads the tensor, so it has arrived before the call returns.
    return t.view(-1)[:1].clone()


def _timed_sends(device: str, megabytes: float, rounds: int) -> float:
    """The fastest of `rounds` sends of a tensor of `megabytes` on `device` to rank 1."""
    t = torch.ones(int(megabytes * 1e6) // 4, device=device)
    best = float("inf")
    for _ in range(rounds + 1):  # the first round warms the channel up
        start = time.perf_counter()
        rpc.rpc_sync("rank1", _answer, args=(t,))
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _rank(rank: int, port: int, megabytes: float, rounds: int, cuda: bool) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    if cuda:
        options.set_device_map(f"rank{1 - rank}", {0: 0})
        options.set_devices([0])
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        for device in ("cuda", "cpu") if cuda else ("cpu",):
            seconds = _timed_sends(device, megabytes, rounds)
            print(
                f"rpc, {device} tensor {megabytes:g} MB: {seconds * 1e3:8.2f} ms"
                f" ({megabytes / 1e3 / seconds:6.2f} GB/s)",
                flush=True,
            )
    rpc.shutdown()


def host_round_trip(megabytes: float, rounds: int) -> float:
    """The fastest copy of a CUDA tensor to pageable host memory and back, in one process."""
    t = torch.ones(int(megabytes * 1e6) // 4, device="cuda")
    best = float("inf")
    for _ in range(rounds + 1):
        start = time.perf_counter()
        t.cpu().cuda()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 100 MB: ResNet-50's layer3 output for 128 images at 224 px.
    ap.add_argument("--megabytes", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    print(
        f"rpc_transfer: {machine()}, torch {torch.__version__},"
        f" {torch.cuda.get_device_name(0) if cuda else 'no CUDA'}",
        flush=True,
    )
    if cuda:
        seconds = host_round_trip(args.megabytes, args.rounds)
        print(
            f"in one process, cuda -> host -> cuda {args.megabytes:g} MB: {seconds * 1e3:8.2f} ms"
            f" ({args.megabytes / 1e3 / seconds:6.2f} GB/s)",
            flush=True,
        )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        _rank, args=(free_port(), args.megabytes, args.rounds, cuda), nprocs=2, start_method="spawn"
    )


if __name__ == "__main__":
    main()
