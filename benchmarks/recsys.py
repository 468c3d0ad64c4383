"""DLRM on Criteo-format click logs, as samples per CPU-second of all processes together: the
HybridJob (1 and 2 trainers x 1 and 2 parameter servers, through `pipejob run`) against one
plain process training the same model (pipejob's Recommender: 26 EmbeddingBag tables with
sparse gradients and the same DLRM) on the same data, the same reader and the same batch
(a step's whole batch, --batch, at every trainer count), with the same optimizers
(rowwise Adagrad for the tables, Adam for the dense part).

CPU seconds are each process's user + system time (/proc) between the step lines of
--warmup and --steps (start-up left out); the plain process times itself the same way.
Configurations interleave within each repeat. TorchRec's EmbeddingBagCollection is tried
if it imports (torchrec with fbgemm-gpu-cpu); the table says why where it does not.
It measures; it asserts nothing.

    python benchmarks/recsys.py                  # 2 repeats
    python benchmarks/recsys.py --quick          # 1 repeat, fewer steps
    python benchmarks/recsys.py --plain-only ... # (internal) the plain process
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import load_average, machine, run_job, spread

ROOT = Path(__file__).resolve().parents[1]
TABLES = [f"C{i}" for i in range(1, 27)]


def say(message: str) -> None:
    print(message, flush=True)


def manifest(logs: str, trainers: int, servers: int, args: argparse.Namespace) -> dict:
    tables = [{"name": name, "rows": args.rows, "dim": 16} for name in TABLES]
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": f"recsys-{trainers}t-{servers}s"},
        "spec": {
            "trainers": trainers,
            "parameterServers": servers,
            "embeddings": tables,
            "data": {"criteo": {"train": logs}},
            "dense": {"dlrm": {"bottom": [64], "top": [64, 32]}},
            "sparseOptimizer": {"name": "rowwiseAdagrad", "lr": 0.02},
            "optimizer": {"name": "adam", "lr": 0.001},
            "batchSize": args.batch // trainers,
            "steps": args.steps,
            "logEvery": args.warmup,
            "seed": 0,
            "preflight": {"megabytes": 0.5},
            "rendezvousTimeoutSeconds": 120,
        },
    }


def hybrid(logs: str, trainers: int, servers: int, stem: Path, args: argparse.Namespace) -> dict:
    job = manifest(logs, trainers, servers, args)
    _, wall, deltas = run_job(
        job, stem, stem.name, args.steps, args.warmup, args.timeout, dict(os.environ)
    )
    cpu = sum(d.cpu for d in deltas.values())
    return {"samples": args.batch * (args.steps - args.warmup), "wall": wall, "cpu": cpu}


def plain(logs: str, args: argparse.Namespace, tuned: bool = False) -> dict:
    """One process: the same model, reader, batch and optimizers; times its measured steps.
    `tuned`: with pipejob's malloc (tcmalloc) and passive OpenMP waits, as its processes run."""
    command = [
        sys.executable,
        __file__,
        "--plain-only",
        "--logs",
        logs,
        "--rows",
        str(args.rows),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    env = dict(os.environ)
    if tuned:
        from pipejob.core import levers

        env |= levers.preload_env(env) | {"OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"the plain process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plain_only(args: argparse.Namespace) -> None:
    import torch

    from pipejob.core.kinds.sparse import SparseOptimizer
    from pipejob.core.kinds.tables import Table
    from pipejob.trainer.hybrid import sparse_optimizers
    from pipejob.trainer.workloads import samples
    from pipejob.trainer.workloads.clicklogs import ClickLogs
    from pipejob.trainer.workloads.recsys import DLRM, Recommender, click_loss

    tables = [Table(name=name, rows=args.rows, dim=16, feature=name) for name in TABLES]
    torch.manual_seed(0)
    dense = DLRM(13, 16, TABLES, [64], [64, 32])
    model = Recommender(tables, dense, 0, True)
    optimizers = [
        sparse_optimizers.make(
            list(model.tables.parameters()),
            SparseOptimizer(
                name="rowwiseAdagrad",
                lr=0.02,
                eps=1e-10,
                initial_accumulator_value=0.0,
                beta1=0.9,
                beta2=0.999,
            ),
        ),
        torch.optim.Adam(dense.parameters(), lr=0.001),
    ]
    reader = samples.stream(ClickLogs(args.logs, "logs"), args.batch, (0, 1), 0, TABLES, True)
    for step in range(1, args.steps + 1):
        if step == args.warmup + 1:
            wall, cpu = time.perf_counter(), time.process_time()
        batch = next(reader)
        offsets = {f: batch.offsets(f) for f in TABLES}
        click_loss(model(batch.dense, batch.ids, offsets), batch.labels).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    print(
        json.dumps(
            {
                "samples": args.batch * (args.steps - args.warmup),
                "wall": time.perf_counter() - wall,
                "cpu": time.process_time() - cpu,
            }
        )
    )


def torchrec_status() -> str:
    """Whether TorchRec's EmbeddingBagCollection (fbgemm's CPU kernels) runs with this torch."""
    probe = (
        "import torch, fbgemm_gpu; from torchrec import EmbeddingBagCollection;"
        " print(torch.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if out.returncode == 0:
        return "importable (not yet measured here)"
    last = (out.stderr.strip().splitlines() or ["?"])[-1]
    return f"not run: {last[:160]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--logs",
        default="",
        help="Criteo-format logs (default: 100k lines written by examples/dlrm/make_days.py)",
    )
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--rows", type=int, default=100_000, help="rows of each of the 26 tables")
    ap.add_argument("--batch", type=int, default=512, help="a step's whole batch (512)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--configs",
        default="1x1,2x2,1x2,2x1",
        help="trainers x servers (none: the one-process runs alone)",
    )
    ap.add_argument("--quick", action="store_true", help="1 repeat of 30 steps")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--plain-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.plain_only:
        plain_only(args)
        return 0
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 30, 5
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",") if c != "none"]
    say(
        f"recsys: DLRM, 26 tables of {args.rows} x 16, batch {args.batch} a step,"
        f" {args.steps} steps (the first {args.warmup} left out) x {args.repeats}; {machine()};"
        f" {time.strftime('%Y-%m-%d %H:%M')}"
    )
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="pipejob-recsys-") as tmp:
        logs = args.logs
        if not logs:
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "examples" / "dlrm" / "make_days.py"),
                    "--lines",
                    str(args.lines),
                    "--days",
                    "1",
                    "--val",
                    "10",
                    "--plain",
                    "--out",
                    tmp,
                ],
                check=True,
                capture_output=True,
            )
            logs = str(Path(tmp) / "day_0.tsv")
        for repeat in range(1, args.repeats + 1):
            runs: list[tuple[str, Any]] = [
                ("one process", lambda: plain(logs, args)),
                ("one process, tcmalloc + passive waits", lambda: plain(logs, args, True)),
            ]
            for t, s in configs:
                stem = Path(tmp) / f"hybrid-{t}t-{s}s-{repeat}"
                label = f"HybridJob {t} trainer(s), {s} server(s)"
                runs.append((label, lambda t=t, s=s, stem=stem: hybrid(logs, t, s, stem, args)))
            for label, run in runs:
                try:
                    got = run()
                except (RuntimeError, TimeoutError) as e:  # a shared machine stalls a world
                    say(f"  repeat {repeat}: {label}: failed, left out: {str(e)[-300:]}")
                    continue
                results.setdefault(label, []).append(got)
                say(
                    f"  repeat {repeat}: {label:<36} {got['samples'] / got['cpu']:8,.0f}"
                    f" samples/CPU-s {got['samples'] / got['wall']:8,.0f} samples/s"
                    f" ({load_average()})"
                )
    report(results, torchrec_status())
    return 0


def report(results: dict[str, list[dict]], torchrec: str) -> None:
    say("\n| run | samples per CPU-second | vs one process | samples/s (wall) |")
    say("|---|---|---|---|")
    per_cpu = {k: spread([r["samples"] / r["cpu"] for r in v]) for k, v in results.items()}
    base = per_cpu["one process"][1]
    for label, values in results.items():
        lo, mid, hi = per_cpu[label]
        wall = spread([r["samples"] / r["wall"] for r in values])[1]
        say(f"| {label} | {mid:,.0f} [{lo:,.0f}-{hi:,.0f}] | {mid / base:.2f}x | {wall:,.0f} |")
    say(f"| TorchRec EmbeddingBagCollection | {torchrec} | | |")


if __name__ == "__main__":
    sys.exit(main())
