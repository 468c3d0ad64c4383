"""Checks of the findings in issue 6, each a small measurement on real processes:

  reactor   CPU burnt by TensorPipe's threads in an idle RPC world, default transports vs uv
  threads   which threads compute a stage's forward and backward, and whether
            torch.set_num_threads(1) bounds them as OMP_NUM_THREADS=1 does
  lock      forwards that reach a tutorial shard together: the order its lock runs them in
            and how long each waits
  balance   one thread's cost of each half of the tutorial's ResNet-50 split (and pipejob's
            own cut) as the micro-batch size changes
  transfer  RPC time of the tensors a 2-stage ResNet-50 step sends, against its compute

    python benchmarks/findings.py reactor threads lock balance transfer

Everything runs on loopback; it prints figures and asserts nothing."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

from _common import (
    Workers,
    counters,
    free_port,
    load_average,
    machine,
    python,
    result,
    thread_env,
    tutorial_split,
)

BATCH, IMAGE = 48, 64


def say(message: str) -> None:
    print(message, flush=True)


def world(
    experiment: str, extra: list[str], env: dict[str, str], timeout: float = 300, ranks: int = 2
) -> list[dict[str, Any]]:
    """Run `experiment` as an RPC world of `ranks` processes; rank 0's results."""
    port = str(free_port())
    with Workers(echo=lambda n, line: say(f"    {n}: {line}") if "rror" in line else None) as w:
        for r in range(ranks):
            w.start(
                f"rank{r}",
                python("findings.py", experiment, "--rank", str(r), "--port", port, *extra),
                env,
            )
        codes = w.wait(timeout)
        if any(codes.values()):
            raise RuntimeError(f"{experiment} failed ({codes}):\n{w.tail()}")
        return w.results


def join(rank: int, port: int, ranks: int = 2, transports: str = "") -> None:
    """Join the experiment's RPC world; `transports` "uv/basic" picks TensorPipe's."""
    import torch.distributed.rpc as rpc

    kwargs: dict[str, Any] = {}
    if transports:
        transport, channel = transports.split("/")
        kwargs = {"_transports": [transport], "_channels": [channel]}
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=16, **kwargs
    )
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=ranks, rpc_backend_options=options)


def own_counters() -> dict[str, Any]:
    c = counters(os.getpid())
    return {"cpu": c.cpu, "minflt": c.minflt, "threads": c.threads}


# ---------------------------------------------------------------------------- reactor


def reactor_rank(args: argparse.Namespace) -> None:
    import torch.distributed.rpc as rpc

    join(args.rank, args.port, transports=args.transports)
    before = counters(os.getpid())
    time.sleep(args.seconds)
    delta = counters(os.getpid()) - before
    rpc.shutdown()
    result({"rank": args.rank, "cpu": delta.cpu, "threads": delta.threads})


def reactor() -> None:
    say("reactor: CPU-seconds per second of an idle 2-process RPC world, by thread")
    for transports in ("", "shm/basic", "uv/basic"):
        env = thread_env(1)
        # Every rank reports: gather them all from the workers' output.
        port = str(free_port())
        with Workers() as w:
            for r in range(2):
                w.start(
                    f"rank{r}",
                    python(
                        "findings.py",
                        "reactor",
                        "--rank",
                        str(r),
                        "--port",
                        port,
                        "--transports",
                        transports,
                        "--seconds",
                        "5",
                    ),
                    env,
                )
            w.wait(120)
            for res in w.results:
                busiest = sorted(res["threads"].items(), key=lambda kv: -kv[1])[:3]
                threads = ", ".join(f"{n} {s / 5:.2f}" for n, s in busiest if s > 0)
                say(
                    f"  {transports or 'default':<10} rank {res['rank']}: {res['cpu'] / 5:.2f}"
                    f" CPU-s/s ({threads}); {load_average()}"
                )


# ---------------------------------------------------------------------------- threads


_SHARD: Any = None
_TEAMS: dict[str, set[int]] = {"forward": set(), "backward": set()}


def omp_max_threads() -> int:
    """OpenMP's thread count for a parallel region started by the calling thread (its own
    ICV: torch.set_num_threads sets it only in the thread that calls it)."""
    import ctypes

    path = next(line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line)
    return ctypes.CDLL(path).omp_get_max_threads()


def shard_forward(x):
    """A stage's forward as RPC runs it (in an RPC worker thread), noting the OpenMP team
    size of this thread and of the thread that later runs its backward."""
    global _SHARD
    import torch

    if _SHARD is None:
        torch.manual_seed(0)
        _SHARD = tutorial_split()[1]
    _TEAMS["forward"].add(omp_max_threads())
    y = _SHARD(x)
    y.grad_fn.register_prehook(lambda grads: _TEAMS["backward"].add(omp_max_threads()))
    return y


def teams() -> dict[str, list[int]]:
    return {k: sorted(v) for k, v in _TEAMS.items()}


def threads_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    if args.api_threads:
        torch.set_num_threads(args.api_threads)
    join(args.rank, args.port)
    if args.rank == 0:
        x = torch.randn(24, 512, 8, 8, requires_grad=True)
        for i in range(args.repeats + 1):
            if i == 1:
                before = rpc.rpc_sync("w1", own_counters)
                start = time.perf_counter()
            with dist_autograd.context() as ctx:
                y = rpc.rpc_sync("w1", shard_forward, args=(x,))
                dist_autograd.backward(ctx, [y.sum()])
        wall = time.perf_counter() - start
        after = rpc.rpc_sync("w1", own_counters)
        counts = rpc.rpc_sync("w1", thread_counts)
        omp = rpc.rpc_sync("w1", teams)
        result(
            {
                "omp": omp,
                "wall": wall / args.repeats,
                "cpu": (after["cpu"] - before["cpu"]) / args.repeats,
                "threads": {
                    n: (after["threads"].get(n, 0) - before["threads"].get(n, 0)) / args.repeats
                    for n in after["threads"]
                },
                "counts": counts,
            }
        )
    rpc.shutdown()


def thread_counts() -> dict[str, int]:
    """Threads of this process by name, counting only those that have used CPU."""
    import re

    out: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        text = open(f"/proc/self/task/{tid}/stat").read()
        name = re.sub(r"\d+$", "#", text[text.index("(") + 1 : text.rindex(")")])
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[11]) + int(fields[12]) > 0:
            out[name] = out.get(name, 0) + 1
    return out


def threads() -> None:
    say(
        "threads: a stage's forward (RPC thread) and distributed backward, second half of the"
        " split at micro-batch 24; per step, in the worker"
    )
    cases = {
        "torch defaults": ({}, []),
        "torch.set_num_threads(1)": ({}, ["--api-threads", "1"]),
        "OMP_NUM_THREADS=1": ({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, []),
    }
    for label, (extra_env, extra_args) in cases.items():
        env = {
            k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
        }
        env |= extra_env
        [res] = world("threads", ["--repeats", "3", *extra_args], env)
        busiest = sorted(res["threads"].items(), key=lambda kv: -kv[1])[:4]
        names = ", ".join(f"{n} {s:.2f}" for n, s in busiest if s > 0.005)
        counts = ", ".join(f"{n} x{c}" for n, c in sorted(res["counts"].items()))
        omp = ", ".join(f"{k} {v}" for k, v in res["omp"].items())
        say(
            f"  {label:<26} OpenMP team size in the forward's and backward's threads: {omp}\n"
            f"  {'':<26} {res['wall']:.2f} s/step wall, {res['cpu']:.2f} CPU-s/step ({names})\n"
            f"  {'':<26} threads that ever ran: {counts}; {load_average()}"
        )


# ---------------------------------------------------------------------------- lock


def lock_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed.rpc as rpc

    join(args.rank, args.port)
    if args.rank == 0:
        micro = BATCH // args.m
        rows = []
        for _ in range(args.repeats + 1):
            rpc.rpc_sync("w1", locked_reset)
            xs = [torch.randn(micro, 3, IMAGE, IMAGE) for _ in range(args.m)]
            futures = [rpc.rpc_async("w1", locked_forward, args=(x, i)) for i, x in enumerate(xs)]
            torch.futures.wait_all(futures)
            rows.append(rpc.rpc_sync("w1", locked_log))
        result({"m": args.m, "runs": rows[1:]})
    rpc.shutdown()


_LOCKED: dict[str, Any] = {}


def locked_reset() -> None:
    import torch

    if "shard" not in _LOCKED:
        torch.manual_seed(0)
        _LOCKED["shard"], _LOCKED["lock"] = tutorial_split()[0], threading.Lock()
    _LOCKED["log"] = []


def locked_forward(x, index: int):
    arrived = time.perf_counter()
    with _LOCKED["lock"]:
        start = time.perf_counter()
        y = _LOCKED["shard"](x)
        end = time.perf_counter()
    _LOCKED["log"].append((index, arrived, start, end))
    return y.shape


def locked_log() -> list[tuple[int, float, float, float]]:
    return sorted(_LOCKED["log"], key=lambda row: row[2])


def lock() -> None:
    say("lock: m forwards sent at once to a tutorial shard (first half, under its lock)")
    for m in (4, 8):
        [res] = world("lock", ["--m", str(m), "--repeats", "2"], thread_env(1))
        for run in res["runs"]:
            order = [row[0] for row in run]
            t0 = min(row[1] for row in run)
            arrival = sorted(run, key=lambda row: row[1])
            arrived_order = [row[0] for row in arrival]
            waits = [row[2] - row[1] for row in run]
            compute = [row[3] - row[2] for row in run]
            first_done = min(row[3] for row in run) - t0
            say(
                f"  m={m}: ran in order {order} (arrived {arrived_order}); waits"
                f" {min(waits):.2f}-{max(waits):.2f}s, compute {statistics.median(compute):.2f}s"
                f" each; first output after {first_done:.2f}s, all after"
                f" {max(row[3] for row in run) - t0:.2f}s; {load_average()}"
            )


# ---------------------------------------------------------------------------- balance


def balance_rank(args: argparse.Namespace) -> None:
    """One process on one thread, as each stage of the 2-core pipeline gets. CPU time of this
    thread (robust to other load): forward + backward of each half of the tutorial's split
    for a whole batch of 48 run as 48/micro micro-batches; and pipejob's own cut (its
    wall-clock cost measurement) at each size."""
    import torch

    from pipejob.trainer.pipeline.balance import measure_costs, min_max_partition
    from pipejob.trainer.workloads.torchvision import build_model, cut

    torch.manual_seed(0)
    first, second = tutorial_split()
    layers = cut(build_model("resnet50", 1000))
    names = [n for n, _ in layers]
    rows = []
    for micro in (48, 24, 12, 6, 3):
        halves = []
        for half, shape in ((first, (micro, 3, IMAGE, IMAGE)), (second, (micro, 512, 8, 8))):
            best = float("inf")
            for _ in range(args.repeats):
                start = time.thread_time()
                for _ in range(BATCH // micro):
                    x = torch.randn(shape, requires_grad=half is second)
                    half(x).sum().backward()
                best = min(best, time.thread_time() - start)
            halves.append(best)
        costs = measure_costs(
            layers, torch.randn(micro, 3, IMAGE, IMAGE), repeats=args.repeats
        ).seconds
        cut_at = min_max_partition(costs, 2)[1].start
        rows.append(
            {
                "micro": micro,
                "first": halves[0],
                "second": halves[1],
                "cut": names[cut_at],
                "cut_share": sum(costs[:cut_at]) / sum(costs),
                "load": load_average(),
            }
        )
    result({"threads": torch.get_num_threads(), "rows": rows})


def balance() -> None:
    [res] = world("balance", ["--repeats", "2"], thread_env(1), ranks=1)
    say(
        f"balance: {res['threads']} thread; CPU-seconds of forward+backward for a batch of"
        f" {BATCH} run as micro-batches (min of 2); tutorial split conv1..layer2 | layer3..fc"
    )
    say(
        f"  {'micro':>5} {'first':>7} {'second':>7} {'2nd/1st':>7} {'sum':>6} {'vs 48':>6}"
        "  pipejob's cut at this size (share before it)"
    )
    base = res["rows"][0]["first"] + res["rows"][0]["second"]
    for r in res["rows"]:
        total = r["first"] + r["second"]
        say(
            f"  {r['micro']:>5} {r['first']:>7.3f} {r['second']:>7.3f}"
            f" {r['second'] / r['first']:>7.2f} {total:>6.2f} {total / base:>6.2f}"
            f"  {r['cut']} ({r['cut_share']:.0%}); {r['load']}"
        )


# ---------------------------------------------------------------------------- transfer


def echo_tensor(x):
    return x


def transfer_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed.rpc as rpc

    join(args.rank, args.port, transports=args.transports)
    if args.rank == 0:
        sizes = {
            "input (micro 24, 3x64x64)": (24, 3, IMAGE, IMAGE),
            "activation layer2 (micro 24, 512x8x8)": (24, 512, 8, 8),
            "output (micro 24, 1000)": (24, 1000),
        }
        out = {}
        for name, shape in sizes.items():
            x = torch.randn(shape)
            rpc.rpc_sync("w1", echo_tensor, args=(x,))
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                rpc.rpc_sync("w1", echo_tensor, args=(x,))
                times.append(time.perf_counter() - start)
            out[name] = {"mb": x.numel() * 4 / 1e6, "round_trip": statistics.median(times)}
        result(out)
    rpc.shutdown()


def transfer() -> None:
    say(
        "transfer: RPC round trip (there and back) of each tensor a 2-stage step sends,"
        " median of 10"
    )
    for transports in ("", "uv/basic"):
        [res] = world("transfer", ["--transports", transports, "--repeats", "10"], thread_env(1))
        for name, r in res.items():
            say(
                f"  {transports or 'default':<9} {name:<40} {r['mb']:6.2f} MB"
                f" {r['round_trip'] * 1000:7.1f} ms; {load_average()}"
            )
    say(
        "  per step of batch 48 in 2 micro-batches: input x2 one way, activation x2 there and"
        " its gradient back, output x2 there and its gradient back"
    )


EXPERIMENTS = {
    "reactor": reactor,
    "threads": threads,
    "lock": lock,
    "balance": balance,
    "transfer": transfer,
}
RANKS = {
    "reactor": reactor_rank,
    "threads": threads_rank,
    "lock": lock_rank,
    "balance": balance_rank,
    "transfer": transfer_rank,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiments", nargs="+", choices=EXPERIMENTS)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--transports", default="")
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--m", type=int, default=4)
    ap.add_argument("--api-threads", type=int)
    args = ap.parse_args()
    if args.rank is not None:
        RANKS[args.experiments[0]](args)
        return 0
    say(f"findings: {machine()}")
    for name in args.experiments:
        EXPERIMENTS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
