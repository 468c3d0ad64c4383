"""DLRM on Criteo-format click logs, as samples per CPU-second of all processes together: the
HybridJob (1 and 2 trainers x 1 and 2 parameter servers, through `pipejob run`) against one
plain process training the same model (pipejob's Recommender: 26 EmbeddingBag tables with
sparse gradients and the same DLRM) on the same data, the same reader and the same batch
(a step's whole batch, --batch, at every trainer count), with the same optimizers
(rowwise Adagrad for the tables, Adam for the dense part), and against TorchRec's DLRM
(benchmarks/_torchrec.py: 2 ranks, DistributedModelParallel with its planner's plan,
fused rowwise Adagrad, in an environment of its own that it makes once). Each run's held-out
AUC after its steps, on the same held-out lines, is in the table too. The one process and
TorchRec's ranks read the samples a 2-trainer HybridJob's trainers read in each step (its
reader's two lanes; TorchRec's rank r what trainer r reads), and all start from pipejob's
weights at --seed (TorchRec's loaded into its shards; --torchrec-own-weights: it draws its
own, from the same distributions), so the 2-trainer rows are compared on the same samples in
the same steps from the same model.

CPU seconds are each process's user + system time (/proc) over steps --warmup + 1 to
--steps - --warmup, between the master's step lines (start-up left out); the plain processes
and TorchRec's ranks time the same steps themselves. The window ends a log interval before
the last step: a HybridJob evaluates on the held-out lines after its last step and before it
logs that step, and every run's evaluation stays out of its window alike. Configurations
interleave within each repeat.
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

import _torchrec
from _common import load_average, machine, run_job, spread

ROOT = Path(__file__).resolve().parents[1]
TABLES = [f"C{i}" for i in range(1, 27)]
TORCHREC = "TorchRec DLRM, 2 ranks (DMP)"
TORCHREC_TUNED = "TorchRec DLRM, 2 ranks, tcmalloc + passive waits"
PLAIN_TUNED = "one process, tcmalloc + passive waits"
LANES = 2  # the one process and TorchRec read a 2-trainer job's lanes (its samples a step)


def say(message: str) -> None:
    print(message, flush=True)


def manifest(
    logs: str, trainers: int, servers: int, args: argparse.Namespace, in_trainers: bool = False
) -> dict:
    """The benchmark's HybridJob; `in_trainers`: its servers in the trainers' processes."""
    tables = [{"name": name, "rows": args.rows, "dim": _torchrec.DIM} for name in TABLES]
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": f"recsys-{trainers}t-{servers}s{'i' if in_trainers else ''}"},
        "spec": {
            "trainers": trainers,
            "parameterServers": servers,
            "serversInTrainers": in_trainers,
            "embeddings": tables,
            "data": {"criteo": {"train": logs, "val": args.val_logs}},
            "eval": {},  # at the end, after the measured steps
            "dense": {"dlrm": {"bottom": list(_torchrec.BOTTOM), "top": list(_torchrec.TOP)}},
            "sparseOptimizer": {"name": "rowwiseAdagrad", "lr": 0.02},
            "optimizer": {"name": "adam", "lr": 0.001},
            "batchSize": args.batch // trainers,
            "steps": args.steps,
            "logEvery": args.warmup,
            "seed": args.seed,
            "preflight": {"megabytes": 0.5},
            "rendezvousTimeoutSeconds": 120,
        },
    }


def hybrid(
    logs: str,
    trainers: int,
    servers: int,
    stem: Path,
    args: argparse.Namespace,
    in_trainers: bool = False,
) -> dict:
    """One HybridJob run through `pipejob run`: its samples, wall and CPU seconds of all its
    processes, held-out AUC and each process's CPU ms a step."""
    job = manifest(logs, trainers, servers, args, in_trainers)
    summary, wall, deltas = run_job(
        job, stem, stem.name, args.until, args.warmup, args.timeout, dict(os.environ)
    )
    cpu = sum(d.cpu for d in deltas.values())
    steps = args.until - args.warmup
    samples = args.batch * steps
    # Each process's CPU ms a step: where the job's CPU goes (servers, trainers, master).
    per_step = {name: 1000 * d.cpu / steps for name, d in sorted(deltas.items())}
    return {
        "samples": samples,
        "wall": wall,
        "cpu": cpu,
        "auc": summary.get("evalAuc"),
        "processes": per_step,
    }


def plain(logs: str, args: argparse.Namespace, tuned: bool = False) -> dict:
    """One process: the same model, reader, batch and optimizers; times its measured steps.
    `tuned`: with pipejob's malloc (tcmalloc) and passive OpenMP waits, as its processes run."""
    command = [
        sys.executable,
        __file__,
        "--plain-only",
        "--logs",
        logs,
        "--val-logs",
        args.val_logs,
        "--rows",
        str(args.rows),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--until",
        str(args.until),
        "--seed",
        str(args.seed),
    ]
    env = tuned_env() if tuned else dict(os.environ)
    out = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"the plain process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def torchrec(ordered: str, weights: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    """TorchRec's run on `ordered` (`write_in_steps_order`'s lines), from `weights` ("": its
    own)."""
    return _torchrec.run(ordered, args.val_logs, args, env, weights)


def write_in_steps_order(logs: str, args: argparse.Namespace, path: Path) -> None:
    """The lines a 2-trainer HybridJob reads in its --steps steps (from --seed), to `path` in
    that order: each step trainer 0's share, then trainer 1's, as pipejob's reader deals them
    (samples.stream: a sample's id is its file's index and its line's offset, clicklogs.py)."""
    from pipejob.trainer.workloads import samples
    from pipejob.trainer.workloads.clicklogs import ID_BITS, ClickLogs

    streams = [
        samples.stream(ClickLogs(logs, "logs", LANES), args.batch, (k, LANES), args.seed, [], True)
        for k in range(LANES)
    ]
    files = ClickLogs(logs, "logs").files
    texts = [Path(name).read_bytes() for name in files]  # plain files: the benchmark's
    with open(path, "wb") as out:
        for _ in range(args.steps):
            for reader in streams:
                for line_id in next(reader).sample_ids:
                    text, offset = texts[line_id >> ID_BITS], line_id & ((1 << ID_BITS) - 1)
                    end = text.find(b"\n", offset)
                    out.write(text[offset : end if end >= 0 else len(text)] + b"\n")


def tuned_env() -> dict[str, str]:
    """The environment with pipejob's malloc (tcmalloc) and passive OpenMP waits."""
    from pipejob.core import tuning_levers

    env = dict(os.environ)
    return env | tuning_levers.preload_env(env) | {"OMP_WAIT_POLICY": "PASSIVE"}


def plain_only(args: argparse.Namespace) -> None:
    import torch

    from pipejob.core.kinds.sparse import SparseOptimizer
    from pipejob.core.kinds.tables import Table
    from pipejob.trainer.hybrid import sparse_optimizers
    from pipejob.trainer.workloads import samples
    from pipejob.trainer.workloads.clicklogs import ClickLogs
    from pipejob.trainer.workloads.recsys import DLRM, Recommender, auc, click_loss

    tables = [Table(name=name, rows=args.rows, dim=_torchrec.DIM, feature=name) for name in TABLES]
    torch.manual_seed(args.seed)  # as a HybridJob's trainers draw the dense part
    dense = DLRM(_torchrec.DENSE, _torchrec.DIM, TABLES, _torchrec.BOTTOM, _torchrec.TOP)
    model = Recommender(tables, dense, args.seed, True)
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
    logs = ClickLogs(args.logs, "logs", LANES)  # both lanes: the 2-trainer job's batches
    reader = samples.stream(logs, args.batch, (0, 1), args.seed, TABLES, True)
    for step in range(1, args.steps + 1):
        if step == args.warmup + 1:
            wall, cpu = time.perf_counter(), time.process_time()
        batch = next(reader)
        offsets = {f: batch.offsets(f) for f in TABLES}
        click_loss(model(batch.dense, batch.ids, offsets), batch.labels).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        if step == args.until:
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    held_out = ClickLogs(args.val_logs, "val")
    with torch.no_grad():
        scored = [
            (model(b.dense, b.ids, {f: b.offsets(f) for f in TABLES}), b.labels)
            for b in samples.in_order(held_out, args.batch, TABLES, True)
        ]
    figure = auc(torch.cat([s for s, _ in scored]), torch.cat([y for _, y in scored]))
    samples_ = args.batch * (args.until - args.warmup)
    print(json.dumps({"samples": samples_, "wall": wall, "cpu": cpu, "auc": figure}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--logs",
        default="",
        help="Criteo-format logs (default: 100k lines written by examples/dlrm/make_days.py)",
    )
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--val-lines", type=int, default=20_000, help="held-out lines (for the AUC)")
    ap.add_argument("--val-logs", default="", help="held-out logs (default: written with --logs)")
    ap.add_argument("--no-torchrec", action="store_true", help="leave TorchRec's run out")
    ap.add_argument(
        "--torchrec-own-weights",
        action="store_true",
        help="TorchRec draws its own initial weights (default: pipejob's at --seed)",
    )
    ap.add_argument("--rows", type=int, default=100_000, help="rows of each of the 26 tables")
    ap.add_argument("--batch", type=int, default=512, help="a step's whole batch (512)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10, help="left out at the start and the end")
    ap.add_argument("--until", type=int, default=0, help=argparse.SUPPRESS)  # --plain-only's
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="every run's weights and order (0)")
    ap.add_argument(
        "--configs",
        default="1x1,2x2,1x2,2x1",
        help="trainers x servers, with an i for servers in the trainers' processes (2x2i;"
        " none: the one-process runs alone)",
    )
    ap.add_argument("--quick", action="store_true", help="1 repeat of 30 steps")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--plain-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.plain_only:
        plain_only(args)
        return 0
    if args.logs and not args.val_logs:
        ap.error("--logs needs --val-logs: the held-out lines every run's AUC is measured on")
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 30, 5
    args.until = args.steps - args.warmup  # the last step measured (the module's docstring)
    if args.warmup < 1:
        ap.error(f"--warmup {args.warmup}: at least 1 (the steps left out, the jobs' log interval)")
    if args.until <= args.warmup or args.steps % args.warmup:
        ap.error(
            f"--steps {args.steps}: a multiple of --warmup ({args.warmup}, the jobs' log"
            " interval) above 2 x --warmup, so that steps are left to measure"
        )
    configs = [config(c) for c in args.configs.split(",") if c != "none"]
    say(
        f"recsys: DLRM, 26 tables of {args.rows} x 16, batch {args.batch} a step,"
        f" {args.steps} steps (steps {args.warmup + 1}-{args.until} measured) x {args.repeats};"
        f" {machine()};"
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
                    str(args.val_lines),
                    "--plain",
                    "--out",
                    tmp,
                ],
                check=True,
                capture_output=True,
            )
            logs, args.val_logs = str(Path(tmp) / "day_0.tsv"), str(Path(tmp) / "val.tsv")
        ordered, weights = Path(tmp) / "in_steps_order.tsv", Path(tmp) / "weights.pt"
        if not args.no_torchrec:
            write_in_steps_order(logs, args, ordered)
            _torchrec.write_pipejob_weights(str(weights), args.rows, args.seed)
        start = "" if args.torchrec_own_weights else str(weights)
        for repeat in range(1, args.repeats + 1):
            runs: list[tuple[str, Any]] = [
                ("one process", lambda: plain(logs, args)),
                (PLAIN_TUNED, lambda: plain(logs, args, True)),
            ]
            for t, s, inside in configs:
                stem = Path(tmp) / f"hybrid-{t}t-{s}s{'i' * inside}-{repeat}"
                label = f"HybridJob {t} trainer(s), {s} server(s){' in them' * inside}"
                runs.append(
                    (
                        label,
                        lambda t=t, s=s, i=inside, stem=stem: hybrid(logs, t, s, stem, args, i),
                    )
                )
            if not args.no_torchrec:
                runs += [
                    (TORCHREC, lambda: torchrec(str(ordered), start, args, dict(os.environ))),
                    (TORCHREC_TUNED, lambda: torchrec(str(ordered), start, args, tuned_env())),
                ]
            for label, run in runs:
                try:
                    got = run()
                except (RuntimeError, TimeoutError) as e:  # a shared machine stalls a world
                    say(f"  repeat {repeat}: {label}: failed, left out: {str(e)[-300:]}")
                    continue
                results.setdefault(label, []).append(got)
                said = f"; the planner chose {got['sharding']}" if "sharding" in got else ""
                if "processes" in got:
                    shares = (f"{n} {ms:.1f}" for n, ms in got["processes"].items() if ms >= 0.05)
                    said += f"; CPU ms a step: {', '.join(shares)}"
                say(
                    f"  repeat {repeat}: {label:<36} {got['samples'] / got['cpu']:8,.0f}"
                    f" samples/CPU-s {got['samples'] / got['wall']:8,.0f} samples/s,"
                    f" AUC {got['auc'] or float('nan'):.4f} ({load_average()}){said}"
                )
    report(results)
    return 0


def config(word: str) -> tuple[int, int, bool]:
    """A --configs word: (trainers, servers, servers in the trainers' processes)."""
    inside = word.endswith("i")
    trainers, servers = (int(x) for x in word.removesuffix("i").split("x"))
    return trainers, servers, inside


def report(results: dict[str, list[dict]]) -> None:
    """The table: each run's samples per CPU-second (median [range]) against the tuned one
    process (issue 59's yardstick) and tuned TorchRec, its samples/s and held-out AUC."""
    say(
        "\n| run | samples per CPU-second | vs one process, tuned | vs TorchRec, tuned"
        " | samples/s (wall) | held-out AUC |"
    )
    say("|---|---|---|---|---|---|")
    per_cpu = {k: spread([r["samples"] / r["cpu"] for r in v]) for k, v in results.items()}
    # Each compared as pipejob tunes a process: with tcmalloc and passive waits.
    plain_base = next((per_cpu[k][1] for k in (PLAIN_TUNED, "one process") if k in per_cpu), None)
    torchrec = next((per_cpu[k][1] for k in (TORCHREC_TUNED, TORCHREC) if k in per_cpu), None)
    for label, values in results.items():
        lo, mid, hi = per_cpu[label]
        wall = spread([r["samples"] / r["wall"] for r in values])[1]
        aucs = [r["auc"] for r in values if r.get("auc") is not None]
        figure = f"{spread(aucs)[1]:.4f}" if aucs else "-"
        say(
            f"| {label} | {mid:,.0f} [{lo:,.0f}-{hi:,.0f}] | {_ratio(mid, plain_base)}"
            f" | {_ratio(mid, torchrec)} | {wall:,.0f} | {figure} |"
        )


def _ratio(value: float, base: float | None) -> str:
    return "-" if base is None else f"{value / base:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
