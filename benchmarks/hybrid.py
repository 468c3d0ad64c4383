"""HybridJob throughput, in one run: this design against today's single-table one on the same
work, and how throughput changes with 1, 2 and 4 parameter servers.

1. One table (`spec.embedding`: an EmbeddingBag of --rows x 16, bags of up to 10 ids,
   Linear(16, 8) under DDP, 2 trainers, --batch bags each, SGD lr 0.05), run by
   - `single-table`: pipejob as of --baseline-rev (the last commit of the single-table design,
     extracted with `git archive`): the table's dense gradient from each trainer, and one
     torch.optim optimizer per trainer stepping the whole table with it, in the backward;
   - `sparse`: this checkout: one call per server per step carrying the ids and the pooled
     embeddings' gradients; the rows the step touched stepped once with the trainers'
     averaged sparse gradient.
2. A recommendation model (26 tables of --table-rows x 16 over synthetic clicks, one id per
   feature, 13 dense features, the built-in DLRM, 2 trainers, --dlrm-batch samples each,
   rowwise Adagrad) on 1, 2 and 4 parameter servers.

Each configuration runs through `pipejob run` (the local runner, with its tuning); samples/s
counts the steps between the master's step lines after --warmup steps (start-up left out),
over every trainer. Configurations interleave within each repeat. It measures; it asserts
nothing. On a machine of 2 cores, 4 servers and 2 trainers share them: the trend, not the
size, of the server counts carries over.

    python benchmarks/hybrid.py                 # 3 repeats (about 15 min here)
    python benchmarks/hybrid.py --quick         # 1 repeat, fewer steps
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import load_average, machine, run_job, spread

ROOT = Path(__file__).resolve().parents[1]
# The last commit of the single-table design (one EmbeddingBag on one parameter server,
# dense gradients, one optimizer per trainer).
BASELINE_REV = "d2844af"
CRITEO_TABLES = 26


def say(message: str) -> None:
    print(message, flush=True)


def baseline_package(rev: str, into: Path) -> Path:
    """pipejob as of `rev`, as an importable folder (put first on PYTHONPATH)."""
    src = into / "src"
    src.mkdir(parents=True)
    paths = ["operator/pipejob", "trainer/pipejob/trainer"]
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, *paths], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    package = into / "package"
    shutil.copytree(src / "operator" / "pipejob", package / "pipejob")
    shutil.copytree(src / "trainer" / "pipejob" / "trainer", package / "pipejob" / "trainer")
    return package


def job(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    common = {
        "trainers": 2,
        "seed": 0,
        "preflight": {"megabytes": 0.5},
        "rendezvousTimeoutSeconds": 120,
    }
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": name},
        "spec": common | spec,
    }


def one_table(rows: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    return job(
        "one-table",
        {
            "embedding": {"numEmbeddings": rows, "dim": 16, "mode": "sum"},
            "dense": {"outFeatures": 8},
            "batchSize": batch,
            "bagSize": 10,
            "datasetSize": 8192,
            "optimizer": {"name": "sgd", "lr": 0.05},
            "steps": steps,
            "logEvery": warmup,
        },
    )


def dlrm(servers: int, rows: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    tables = [{"name": f"C{i}", "rows": rows, "dim": 16} for i in range(1, CRITEO_TABLES + 1)]
    return job(
        "dlrm",
        {
            "parameterServers": servers,
            "embeddings": tables,
            "bagSize": 1,
            "denseFeatures": 13,
            "dense": {"dlrm": {"bottom": [64], "top": [64, 32]}},
            "batchSize": batch,
            "datasetSize": 16384,
            "sparseOptimizer": {"name": "rowwiseAdagrad", "lr": 0.05},
            "optimizer": {"name": "adam", "lr": 0.001},
            "steps": steps,
            "logEvery": warmup,
        },
    )


def measure(
    manifest: dict[str, Any],
    stem: Path,
    steps: int,
    warmup: int,
    env: dict[str, str],
    timeout: float,
) -> float:
    """Samples per second over every trainer, between the step lines of `warmup` and `steps`."""
    spec = manifest["spec"]
    _, wall, _ = run_job(manifest, stem, stem.name, steps, warmup, timeout, env)
    return spec["trainers"] * spec["batchSize"] * (steps - warmup) / wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rows",
        default="1000,1000000",
        help="rows of the one table, comma-separated (1000,1000000)",
    )
    ap.add_argument("--batch", type=int, default=64, help="bags per trainer step (64)")
    ap.add_argument(
        "--table-rows",
        type=int,
        default=100_000,
        help="rows of each of the 26 DLRM tables (100000)",
    )
    ap.add_argument("--dlrm-batch", type=int, default=128, help="samples per trainer (128)")
    ap.add_argument("--servers", default="1,2,4", help="parameter server counts (1,2,4)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one repeat of 60 steps")
    ap.add_argument(
        "--baseline-rev",
        default=BASELINE_REV,
        help=f"git revision of the single-table design ({BASELINE_REV})",
    )
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 60, 10
    rows = [int(r) for r in args.rows.split(",")]
    counts = [int(s) for s in args.servers.split(",")]
    say(
        f"hybrid: 2 trainers; one table of {args.rows} rows x 16 ({args.batch} bags per"
        f" trainer); DLRM with {CRITEO_TABLES} tables of {args.table_rows} x 16"
        f" ({args.dlrm_batch} samples per trainer) on {args.servers} servers; {args.steps}"
        f" steps, the first {args.warmup} left out, x {args.repeats} repeat(s); {machine()};"
        f" {time.strftime('%Y-%m-%d %H:%M')}"
    )
    rates: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="pipejob-hybrid-") as tmp:
        old = baseline_package(args.baseline_rev, Path(tmp) / "baseline")
        path = os.pathsep.join(filter(None, [str(old), os.environ.get("PYTHONPATH")]))
        designs = {"single-table": os.environ | {"PYTHONPATH": path}, "sparse": dict(os.environ)}
        runs = [
            (f"{design} {r}", one_table(r, args.batch, args.steps, args.warmup), env)
            for r in rows
            for design, env in designs.items()
        ]
        runs += [
            (
                f"dlrm {s} server(s)",
                dlrm(s, args.table_rows, args.dlrm_batch, args.steps, args.warmup),
                designs["sparse"],
            )
            for s in counts
        ]
        for repeat in range(1, args.repeats + 1):
            for label, manifest, env in runs:
                t0 = time.monotonic()
                stem = Path(tmp) / label.replace(" ", "-").replace("(", "").replace(")", "")
                rate = measure(manifest, stem, args.steps, args.warmup, env, args.timeout)
                rates.setdefault(label, []).append(rate)
                say(
                    f"  repeat {repeat}: {label:<22} {rate:9,.0f} samples/s"
                    f" ({time.monotonic() - t0:.0f}s with start-up; {load_average()})"
                )
    say("\nsamples/s over both trainers: median [min-max] over repeats")
    median = {}
    for label, values in rates.items():
        lo, mid, hi = spread(values)
        median[label] = mid
        say(f"  {label:<22} {mid:9,.0f} [{lo:,.0f}-{hi:,.0f}]")
    for r in rows:
        ratio = median[f"sparse {r}"] / median[f"single-table {r}"]
        say(f"  sparse / single-table, {r} rows: {ratio:.2f}x")
    one = median[f"dlrm {counts[0]} server(s)"]
    for s in counts[1:]:
        ratio = median[f"dlrm {s} server(s)"] / one
        say(f"  dlrm, {s} servers / {counts[0]}: {ratio:.2f}x")
    say(f"  ({load_average()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
