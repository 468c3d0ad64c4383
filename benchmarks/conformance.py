"""Conformance: does pipejob's cut and per-stage build compute exactly the user's model, for
models nobody here wrote? Each model of each zoo (benchmarks/_zoos.py: every torch.nn module
with parameters, every torchvision classification builder, one timm model per family, every
transformers architecture an auto class builds from a tiny config) is checked against a
plain build in one process, in float64 (benchmarks/_conform.py; in float32 where float64
does not run, or its memory is over --max-params): (a) parameters and buffers
bit-equal per stage, (b) outputs bit-equal in training and evaluation mode, (c) step-1
gradients equal, tied weights included, (d) the output loads strictly into a fresh build;
at two cuts. Each row is exact, eager (the trace refused it, and the eager path computes it
exactly: benchmarks/_conform_eager.py), refused (pipejob says it cannot cut it, and why), failing
(what differs, where), not built (its own library cannot build or run it here), or not run
(over twice --max-params, float32's budget, or past --timeout: a rerun with more time
decides).

Each row also records the engine `engine: auto` runs the model on, and why where it is rpc
(benchmarks/_conform_engine.py: the master's choice from what the model passes into each
place to cut, without training); --engines records only that, for every row in minutes, and
--render merges those rows into a page's table (_conform_page.py reads a page back).

Models run one after another in a worker process, restarted when one crashes or outlasts
--timeout. Progress goes to stdout, one line a model; --table writes the markdown table
(rewritten as rows arrive), which docs/conformance.md holds for the whole zoo.

    python benchmarks/conformance.py                      # every zoo (hours on 2 cores)
    python benchmarks/conformance.py --slice ci           # the representative slice CI runs
    python benchmarks/conformance.py --zoo torch,timm --table /tmp/conformance.md
    python benchmarks/conformance.py --only torchvision:inception_v3,transformers:seq2seq:t5
    python benchmarks/conformance.py --engines --rows /tmp/engines.jsonl   # auto's choices
    python benchmarks/conformance.py --render docs/conformance.md /tmp/engines.jsonl \
        --table docs/conformance.md                # merged into the page's rows
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine
from _conform_page import counts, engines, render, table

# What CI runs: one small model of each construct the issue reported, about a minute on 2
# quiet cores: a non-persistent buffer and cloned layers (TransformerEncoder), a
# parametrization (weight_norm), training and evaluation modes (BatchNorm2d's statistics), a
# sliding attention window (Mistral), tied weights (T5's shared embedding), experts
# (Mixtral), a state-space model (Mamba). The whole zoo is this script without --slice.
CI = [
    "torch:TransformerEncoder",
    "torch:weight_norm",
    "torch:BatchNorm2d",
    "transformers:causal:mistral",
    "transformers:seq2seq:t5",
    "transformers:causal:mixtral",
    "transformers:causal:mamba",
    # issue 41: one of each library users bring beside the zoos
    "diffusers:UNet2DModel",
    "peft:lora causal:llama",
    "open_clip:text tower",
    "x_transformers:decoder",
    "vit_pytorch:ViT",
    "segmentation_models_pytorch:Unet",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zoo", default="torch,torchvision,timm,transformers")
    parser.add_argument("--only", default="", help="rows zoo:name, comma-separated")
    parser.add_argument("--slice", choices=["ci"], help="the representative slice CI runs")
    parser.add_argument("--table", type=Path, help="write the markdown table here")
    parser.add_argument("--rows", type=Path, help="append each row here, as a JSON line")
    parser.add_argument(
        "--render",
        type=Path,
        nargs="+",
        metavar="ROWS",
        help="only write --table from these files of rows (a later row of a"
        " model replaces an earlier one)",
    )
    parser.add_argument(
        "--engines",
        action="store_true",
        help="only record which engine `engine: auto` chooses for each row (no checks, no"
        " training: minutes for every zoo); --render merges such rows into a table's",
    )
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per model")
    parser.add_argument(
        "--max-params",
        type=float,
        default=200e6,
        help="models with more parameters are checked in float32 (half the memory), with"
        " more than twice as many listed, not run",
    )
    args = parser.parse_args()

    if args.render:
        (args.table or Path("/dev/stdout")).write_text(render(args.render))
        return 0
    print(f"conformance: {machine()}", flush=True)
    if args.slice == "ci" or args.only:
        rows = [tuple(r.split(":", 1)) for r in (CI if args.slice else args.only.split(","))]
    else:
        import _zoos

        rows = [(zoo, name) for zoo in args.zoo.split(",") for name in _zoos.names(zoo)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the worker is stopped too
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    ).stdout.strip()
    started = time.perf_counter()
    done: list[dict[str, Any]] = []
    worker = Worker(args.max_params, args.engines)
    try:
        for zoo, name in rows:
            row = worker.check(zoo, name, args.timeout) | {"commit": commit}
            done.append(row)
            if args.rows:
                with args.rows.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            said = row["verdict"] or f"engine {row['engine'] or 'none'}"
            print(
                f"[{len(done)}/{len(rows)}] {zoo} {row['name']}: {said}"
                f"{' (' + row['why'] + ')' if row['why'] else ''} in {row['seconds']:.1f}s",
                flush=True,
            )
            if args.table:
                totals = dict(Counter(zoo for zoo, _ in rows))
                args.table.write_text(table(done, time.perf_counter() - started, totals))
    finally:
        worker.stop()
    seconds = time.perf_counter() - started
    if not args.engines:
        print("\n" + counts(done, seconds))
    print("\n" + engines(done))
    return 0


class Worker:
    """A process that checks one model at a time; replaced when one crashes or hangs."""

    def __init__(self, max_params: float, engines: bool = False):
        self.max_params, self.engines = max_params, engines
        self.context = multiprocessing.get_context("spawn")
        self.process: Any = None

    def _start(self) -> None:
        self.requests, self.replies = self.context.Queue(), self.context.Queue()
        self.process = self.context.Process(
            target=_serve,
            args=(self.requests, self.replies, self.max_params, self.engines),
            daemon=True,
        )
        self.process.start()

    def check(self, zoo: str, name: str, timeout: float) -> dict[str, Any]:
        if self.process is None or not self.process.is_alive():
            self._start()
        self.requests.put((zoo, name))
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.replies.get(timeout=5)
            except queue.Empty:
                if not self.process.is_alive() or time.monotonic() > deadline:
                    # Outlasting the time given says nothing of the cut: not run (a rerun
                    # with a longer --timeout decides); a crash is failing.
                    verdict, why = ("not run", f"ran past --timeout {timeout:g}s")
                    if not self.process.is_alive():
                        verdict = "failing"
                        why = f"the worker died (exit code {self.process.exitcode})"
                    self.stop()
                    return {
                        "zoo": zoo,
                        "name": name,
                        "verdict": verdict,
                        "why": why,
                        "seconds": timeout,
                        "params": 0,
                        "cuts": "",
                    }

    def stop(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        if self.process is not None:  # what is left in the queues goes nowhere now
            self.requests.cancel_join_thread()
            self.replies.cancel_join_thread()
        self.process = None


def _serve(requests: Any, replies: Any, max_params: float, engines: bool) -> None:
    """The worker: torch's threads as the machine allows, one model at a time; with
    `engines`, only auto's choice for each (a row with no verdict)."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # its warnings, once a model
    import _conform
    import _zoos

    while True:
        zoo, name = requests.get()
        start = time.perf_counter()
        try:
            shown, (factory, sample) = _zoos.entry(zoo, name)
        except Exception as e:  # the zoo's own entry fails: not pipejob's
            row = _conform.Row(zoo, name, "" if engines else "not built", _conform._line(e))
        else:
            count = 0 if engines else _count(factory)  # --engines: on the meta device first
            over = _over(count, max_params)
            if over and count > 2 * max_params:
                row = _conform.Row(
                    zoo,
                    shown,
                    "" if engines else "not run",
                    f"{over}; float32, half of it, is over twice --max-params",
                    params=count,
                )
            elif engines:
                row = _engine_only(zoo, shown, factory, sample)
            else:  # over the float64 budget alone: the checks in float32, half its memory
                row = _conform.run(zoo, shown, factory, sample, over)
        row.seconds = time.perf_counter() - start
        replies.put(asdict(row))


def _engine_only(zoo: str, name: str, factory: Any, sample: Any) -> Any:
    """A row with auto's engine for the model, and no verdict."""
    import _conform

    row = _conform.Row(zoo, name, "")
    row.engine = _conform._engine(factory, sample)
    return row


def _over(count: int, max_params: float) -> str | None:
    """Why a model of `count` parameters is over the float64 budget, or None."""
    if count <= max_params:
        return None
    return (
        f"{count / 1e6:.0f}M parameters, over --max-params {max_params / 1e6:.0f}M (float64"
        f" needs {count * 8 * 5 / 2**30:.0f} GiB here)"
    )


def _count(factory: Any) -> int:
    """The model's parameters, counted on the meta device as pipejob's master builds it (a
    builder that computes its widths with tensors, RegNet's, builds there too); 0 where it
    cannot build there (the check itself says why)."""
    from pipejob.trainer.workloads import materialize

    try:
        return sum(p.numel() for p in materialize.build(factory, ())[0].parameters())
    except Exception:
        return 0


if __name__ == "__main__":
    sys.exit(main())
