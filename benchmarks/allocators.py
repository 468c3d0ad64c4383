"""Which malloc pipejob's processes should run with (issue 35): every allocator choice on the
two models the choice is judged by, interleaved in one run, with repeats.

  transformer  memory.py's acceptance model: pipejob's transformer of 24 layers of width 1024
               (303M parameters, 1.21 GB in float32), 4 stages of 6 blocks, SGD, batch 4 in 2
               micro-batches
  resnet50     compare.py's pipejob job: ResNet-50, batch 48, 64x64 images, 2 stages cut as
               the tutorial cuts it (conv1 .. layer2 | layer3 .. fc), m=2

Every run goes through `pipejob run` (the local runner, as a user runs a job). The choices:

  default         PIPEJOB_TUNING unset: what pipejob chooses (pipejob.core.tuning_levers)
  glibc-lever     glibc with the allocator lever's one arena and trim and mmap thresholds (the
                  default before tcmalloc): PIPEJOB_TUNING=threads,transport,allocator=glibc
  glibc           glibc's defaults: PIPEJOB_TUNING=threads,transport
  jemalloc        jemalloc with its own defaults: ...,allocator=jemalloc
  jemalloc-decay  jemalloc keeping what is freed (MALLOC_CONF: torch's own launcher's settings,
                  torch.backends.xeon.run_cpu --enable-jemalloc)
  tcmalloc        tcmalloc (gperftools' minimal library): ...,allocator=tcmalloc
  tcmalloc-decommit  tcmalloc giving freed spans back to the kernel at once:
                  ...,allocator=tcmalloc with TCMALLOC_AGGRESSIVE_DECOMMIT=true
  tcmalloc-mkl-cache  tcmalloc preloaded by hand with the allocator lever off, so MKL keeps
                  its own cache of buffers per thread (the default before it was turned off):
                  PIPEJOB_TUNING=threads,transport, LD_PRELOAD=tcmalloc

Left out unless named: the choice the default is (tcmalloc today), measured as "default".

Printed per choice and model: s/step (median [min-max] over the repeats; step 1, the warm-up,
left out), samples per CPU-second of all the world's processes (robust to other load on the
machine), and each process's peak resident memory (VmHWM, from the master's summary: median
[min-max] over the repeats). It measures; it asserts nothing.

    python benchmarks/allocators.py                       # 3 repeats: over an hour on 2 cores
    python benchmarks/allocators.py --repeats 1 --models resnet50 --choices default,glibc
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import fmt_spread, load_average, machine, run_job
from compare import Config, pipejob_manifest
from memory import manifest as transformer_manifest

from pipejob.core.tuning_levers import DEFAULT_MALLOC, MALLOCS, library_file

GB = 1e9
# jemalloc's settings in torch's launcher (torch/backends/xeon/run_cpu.py, --enable-jemalloc):
# freed memory is never decayed back to the kernel, large blocks get arenas of their own.
KEEPING = (
    "oversize_threshold:1,background_thread:true,metadata_thp:auto,"
    "dirty_decay_ms:9000000000,muzzy_decay_ms:9000000000"
)
NO_LEVER = {"PIPEJOB_TUNING": "threads,transport"}
JEMALLOC = {"PIPEJOB_TUNING": "threads,transport,allocator=jemalloc"}
TCMALLOC = {"PIPEJOB_TUNING": "threads,transport,allocator=tcmalloc"}
CHOICES: dict[str, dict[str, str]] = {
    "default": {},
    "glibc-lever": {"PIPEJOB_TUNING": "threads,transport,allocator=glibc"},
    "glibc": NO_LEVER,
    "jemalloc": JEMALLOC,
    "jemalloc-decay": JEMALLOC | {"MALLOC_CONF": KEEPING},
    "tcmalloc": TCMALLOC,
    "tcmalloc-decommit": TCMALLOC | {"TCMALLOC_AGGRESSIVE_DECOMMIT": "true"},
    "tcmalloc-mkl-cache": NO_LEVER
    | {"LD_PRELOAD": library_file(MALLOCS["tcmalloc"].library) or ""},
}
# The choice the default is (what PIPEJOB_TUNING unset preloads): measured once, as "default".
SAME_AS_DEFAULT = DEFAULT_MALLOC if DEFAULT_MALLOC != "glibc" else "glibc-lever"
# What a choice sets, and what the caller's environment may not add to it.
CLEARED = (
    "PIPEJOB_TUNING",
    "LD_PRELOAD",
    "MALLOC_CONF",
    "TCMALLOC_AGGRESSIVE_DECOMMIT",
    "MKL_DISABLE_FAST_MM",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)
MODELS = ("transformer", "resnet50")
SAID = re.compile(r"(\w+)\s*\| performance settings: .*?malloc ([^,\n]+)")
STEPS, WARMUP = 5, 1


@dataclass
class Run:
    choice: str
    model: str
    seconds_per_step: float
    samples_per_cpu_second: float
    peaks: dict[str, int]  # member -> peak resident bytes
    allocators: dict[str, str]  # member -> what its "performance settings" line said
    load: str
    cut: str  # units per stage


def job(model: str) -> dict[str, Any]:
    if model == "resnet50":
        cfg = Config(
            batch=48,
            image=64,
            counts=[2],
            warmup=WARMUP,
            batches=STEPS - WARMUP,
            pipejob_env={},
            variants={},
            stage_threads=0,
            timeout=0,
            verbose=False,
        )
        spec = pipejob_manifest(cfg, 2)
        spec["spec"]["splitPoints"] = ["layer3.0"]  # the tutorial's cut, a quiet machine's too
        return spec
    shape = argparse.Namespace(
        vocab=256, width=1024, heads=16, seq_len=32, batch=4, micro_batches=2, steps=STEPS
    )
    spec = transformer_manifest(shape, layers=24, stages=4)
    # The cut a quiet machine measures (6 blocks a stage), fixed: under load the measured cut
    # moves blocks between stages, and a stage's peak with them.
    spec["spec"]["splitPoints"] = ["blocks.6", "blocks.12", "blocks.18"]
    return spec


def measure(choice: str, model: str, tmp: Path, timeout: float) -> Run:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED} | CHOICES[choice]
    spec = job(model)
    summary, _, deltas = run_job(
        spec, tmp / f"{model}-{choice}", choice, STEPS, WARMUP, timeout, env
    )
    cpu = sum(d.cpu for name, d in deltas.items() if name != "runner")
    samples = spec["spec"]["batchSize"] * (STEPS - WARMUP)
    log = (tmp / f"{model}-{choice}.log").read_text()
    said = dict(SAID.findall(log))
    cut = "/".join(str(len(st["layers"])) for st in summary["partition"])
    return Run(
        choice,
        model,
        summary["secondsPerStep"],
        samples / cpu,
        {m: f["rssPeakBytes"] for m, f in summary["memory"].items()},
        said,
        load_average(),
        cut,
    )


def report(runs: list[Run], choices: list[str], models: list[str]) -> str:
    lines = []
    for model in models:
        mine = [r for r in runs if r.model == model]
        members = list(dict.fromkeys(m for r in mine for m in r.peaks))
        lines += [
            "",
            f"{model}: s/step and samples per CPU-s, median [min-max] over repeats;"
            " peak resident GB of each process, median [min-max]",
            f"  {'choice':<18} {'s/step':>20} {'per CPU-s':>17}  "
            + "  ".join(f"{m:>17}" for m in members),
        ]
        for choice in choices:
            rs = [r for r in mine if r.choice == choice]
            if not rs:
                continue
            peaks = "  ".join(
                f"{fmt_spread([r.peaks[m] / GB for r in rs if m in r.peaks], 2):>17}"
                for m in members
            )
            lines.append(
                f"  {choice:<18} {fmt_spread([r.seconds_per_step for r in rs], 3):>20}"
                f" {fmt_spread([r.samples_per_cpu_second for r in rs], 2):>17}  {peaks}"
            )
        medians = {
            c: statistics.median(r.seconds_per_step for r in mine if r.choice == c)
            for c in choices
            if any(r.choice == c for r in mine)
        }
        first = choices[0]
        if first in medians:
            lines.append(
                f"  s/step against {first} (medians): "
                + ", ".join(
                    f"{c} {s / medians[first]:.2f}x" for c, s in medians.items() if c != first
                )
            )
    said = {(r.choice, a) for r in runs for a in r.allocators.values()}
    lines += ["", "what the processes said they run with (performance settings):"]
    lines += [f"  {c:<18} malloc {a}" for c, a in sorted(said)] or ["  (nothing said)"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--choices", default=",".join(c for c in CHOICES if c != SAME_AS_DEFAULT))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--json", type=Path, help="also write every run here")
    args = ap.parse_args()
    choices = [c.strip() for c in args.choices.split(",")]
    models = [m.strip() for m in args.models.split(",")]
    wrong = sorted(set(choices) - set(CHOICES)) + sorted(set(models) - set(MODELS))
    if wrong:
        ap.error(f"unknown: {', '.join(wrong)}; choices {list(CHOICES)}, models {list(MODELS)}")
    print(
        f"allocators: {choices} on {models}, {args.repeats} repeat(s) of {STEPS} steps"
        f" (step 1 left out); {machine()}; {time.strftime('%Y-%m-%d %H:%M')}",
        flush=True,
    )
    runs: list[Run] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pipejob-allocators-") as tmp:
        for repeat in range(1, args.repeats + 1):
            for choice in choices:
                for model in models:
                    try:
                        run = measure(choice, model, Path(tmp), args.timeout)
                    except (RuntimeError, TimeoutError) as e:
                        print(f"  {model} {choice} FAILED, left out: {e}", flush=True)
                        continue
                    runs.append(run)
                    peaks = " ".join(f"{m} {b / GB:.2f}" for m, b in run.peaks.items())
                    print(
                        f"[{time.monotonic() - started:5.0f}s] repeat {repeat}: {model:<11}"
                        f" {choice:<18} {run.seconds_per_step:.3f} s/step,"
                        f" {run.samples_per_cpu_second:.2f} samples/CPU-s; peak GB {peaks}"
                        f" (cut {run.cut});"
                        f" {run.load}",
                        flush=True,
                    )
    print(report(runs, choices, models))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    print(f"\ntotal {time.monotonic() - started:.0f}s; {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
