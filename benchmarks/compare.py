"""pipejob's PipelineJob side by side with what users compare it with, in one run, on one
batch, image size, model split and thread budget:

  pipejob   the PipelineJob through the local runner (`pipejob run`), its threads and
            transports chosen by pipejob.trainer.runtime.tuning; rate from the master's summary
  pipejob-auto  the same with `microBatches: auto`: reported with the count it chose,
            beside pipejob at its best fixed count
  pipejob-gpipe, pipejob-1f1b, pipejob-interleaved-1f1b, pipejob-zero-bubble
            the PipelineJob on its pipelining engine (spec.engine), with that schedule (the
            interleaved ones 2 stages per process), at each count the schedule can run
  pipejob-eager  the PipelineJob on the eager path (spec.model.cut: eager, rpc engine): the
            master runs ResNet-50's forward, the stages its costly modules (issue 56)
  baseline  the tutorial's RPC pipeline, written faithfully (baseline_pipeline.py)
  gpipe     torch.distributed.pipelining ScheduleGPipe, 2 processes over gloo
  1f1b      torch.distributed.pipelining Schedule1F1B, 2 processes over gloo
  single-t1 the whole model in one process on one thread
  single-tN the whole model in one process on all N cores
  pipejob@REV  with --at REV: pipejob as it was at git revision REV, its cut and its
            losses printed beside today's (the same seed and data give the same losses when
            the two cut the model alike)

ResNet-50 (1000 classes), batch 48, 64x64 images, SGD; the baseline and pipelining processes
run --stage-threads intra-op threads each (default: their share of the cores, half each),
pipejob what its tuning decides. Each system runs at every micro-batch count of --micro-batches,
--repeats times, interleaved so drift in the machine's load hits every system alike; each is
then reported at its best count by median.

--cores 2,4,8,16 sweeps core counts: each count's runs have the first N CPUs of this
process's affinity and no others (os.sched_setaffinity, inherited by every process a run
starts), their thread counts derived from those N (pipejob's tuning reads its affinity), and
a last table shows each system and ratio across the counts. Counts above the CPUs this
process may use are left out, saying so.

Besides samples/s it prints per-process CPU use, page faults and the busiest threads per batch,
read from /proc between the marks each system prints around its measured batches. It
measures; it asserts nothing.

    python benchmarks/compare.py                 # about 15 minutes on 2 idle cores
    python benchmarks/compare.py --quick         # one repeat of m=2,4: a smoke test
    python benchmarks/compare.py --systems pipejob,baseline --pipejob-env PIPEJOB_TUNING=off
    python benchmarks/compare.py --systems pipejob,pipejob-auto --quick   # auto's choice
    python benchmarks/compare.py --cores 2,4,8,16 --repeats 3   # the trend with the cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from _common import (
    Counters,
    Workers,
    free_port,
    load_average,
    machine,
    python,
    run_job,
    spread,
    thread_env,
    threads_summary,
)

ROOT = Path(__file__).resolve().parent.parent
# pipejob on its rpc engine ("pipejob", "pipejob-auto": micro-batches auto), named, as the
# default engine (auto) would choose pipelining for this job
RPC = {"engine": "rpc"}
# pipejob on its pipelining engine: system -> the spec's engine fields (issue 31)
ENGINES = {
    f"pipejob-{schedule}": {
        "engine": "pipelining",
        "schedule": schedule,
        "stagesPerProcess": 2 if schedule in ("interleaved-1f1b", "zero-bubble") else 1,
    }
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
} | {"pipejob-eager": {"engine": "rpc", "model": {"torchvision": "resnet50", "cut": "eager"}}}
SYSTEMS = (
    "pipejob",
    "pipejob-auto",
    "baseline",
    "gpipe",
    "1f1b",
    "single-t1",
    "single-tN",
    *ENGINES,
)
AUTO = "auto"


@dataclass
class Run:
    """One measured configuration: a system at a micro-batch count, in one repeat."""

    system: str
    m: int | str  # or "auto"
    rate: float  # samples/s
    load: str
    wall: float = 0.0  # seconds between the marks
    batches: int = 0
    processes: dict[str, Counters] = field(default_factory=dict)
    bubble: float | None = None  # pipejob's own measure, when it has one
    batch: int = 48
    chosen: int | None = None  # the count `microBatches: auto` chose
    cut: str = ""  # pipejob: where each stage after the first begins
    losses: list[float] = field(default_factory=list)  # pipejob: per step
    cores: int = 0  # the CPUs its processes had (--cores)


@dataclass
class Config:
    batch: int
    image: int
    counts: list[int]
    warmup: int
    batches: int
    pipejob_env: dict[str, str]
    variants: dict[str, dict[str, str]]  # pipejob under other environments: label -> env
    stage_threads: int  # intra-op threads of each baseline / torch.distributed.pipelining process
    timeout: float
    verbose: bool


def say(message: str) -> None:
    print(message, flush=True)


def echo(verbose: bool):
    def show(name: str, line: str) -> None:
        if verbose or "error:" in line or "Traceback" in line:
            say(f"    {name}: {line}")

    return show


# ---------------------------------------------------------------------------- the systems


def pipejob_manifest(
    cfg: Config, m: int | str, engine: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": f"compare-m{m}"},
        "spec": {
            "model": "resnet50",
            "stages": 2,
            "microBatches": m,
            "batchSize": cfg.batch,
            "imageSize": cfg.image,
            "numClasses": 1000,
            "steps": cfg.warmup + cfg.batches,
            "logEvery": 1,
            "optimizer": {"name": "sgd", "lr": 0.05},
            "seed": 0,
            **(engine or {}),
        },
    }


def checkout(rev: str, tmp: Path) -> Path:
    """pipejob's sources at git revision `rev`, importable as `pipejob` from the returned
    folder (put it first on PYTHONPATH): the operator's package with the trainer's inside,
    as pyproject.toml's package-dir maps them."""
    src, path = tmp / "src", tmp / "path"
    src.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "operator", "trainer"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    (path / "pipejob").mkdir(parents=True)
    for entry in (src / "operator" / "pipejob").iterdir():
        (path / "pipejob" / entry.name).symlink_to(entry)
    (path / "pipejob" / "trainer").symlink_to(src / "trainer" / "pipejob" / "trainer")
    return path


def run_pipejob(
    cfg: Config, tmp: Path, system: str = "pipejob", extra: dict[str, str] | None = None
) -> list[Run]:
    from pipejob.core.kinds.pipeline_schedules import schedule_refuses

    runs = []
    # pipejob@REV: that revision's default (rpc before engine auto; older ones know no engine)
    # A variant (pipejob-1f1b:LABEL) runs its system's engine.
    engine = ENGINES.get(system.partition(":")[0], {} if system.startswith("pipejob@") else RPC)
    counts = [
        m for m in cfg.counts if schedule_refuses(engine.get("schedule", "gpipe"), 2, m) is None
    ]
    for m in [AUTO] if system == "pipejob-auto" else counts:
        env = {
            k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
        }
        env |= cfg.pipejob_env | (extra or {})
        summary, wall, deltas = run_job(
            pipejob_manifest(cfg, m, engine),
            tmp / f"{system}-m{m}",
            m,
            cfg.warmup + cfg.batches,
            cfg.warmup,
            cfg.timeout,
            env,
            echo(cfg.verbose),
        )
        # The eager path measures no bubble; its summary names its placed modules instead.
        rate, bubble = summary["samplesPerSecond"], summary.get("bubble", {}).get("measured")
        if "placement" in summary:
            cut = ", ".join(names[0] for names in summary["placement"][1:])
        else:
            cut = ", ".join(st["layers"][0] for st in summary["partition"][1:])
        runs.append(
            Run(
                system,
                m,
                rate,
                load_average(),
                wall,
                cfg.batches,
                _named(deltas),
                bubble,
                cfg.batch,
                summary["microBatches"],
                cut,
                summary["losses"],
            )
        )
    return runs


def _named(deltas: dict[str, Counters]) -> dict[str, Counters]:
    """pipejob's processes by role (the runner itself is left out)."""
    return {n: d for n, d in deltas.items() if n != "runner"}


def run_world(
    cfg: Config,
    system: str,
    argvs: dict[str, list[str]],
    names: dict[str, str],
    env: dict[str, str],
) -> list[Run]:
    """Start one process per argv, wait for the first (it leads), collect its results."""
    runs = []
    with Workers(echo(cfg.verbose)) as w:
        for name, argv in argvs.items():
            w.start(name, argv, env)
        lead = next(iter(argvs))
        codes = w.wait(cfg.timeout, main=lead)
        if codes[lead] != 0:
            raise RuntimeError(f"{system} failed ({codes}):\n{w.tail()}")
        for r in w.results:
            key = f"{r['system']}-m{r['m']}" if r["system"] in ("gpipe", "1f1b") else None
            key = key or (f"m{r['m']}" if r["system"] == "baseline" else r["system"])
            wall, deltas = w.between(f"{key}-start", f"{key}-end")
            processes = {names[n]: d for n, d in deltas.items()}
            runs.append(
                Run(
                    _system_name(r),
                    r["m"],
                    r["samples_per_second"],
                    load_average(),
                    wall,
                    len(r["batch_seconds"]),
                    processes,
                    batch=cfg.batch,
                )
            )
    return runs


def _system_name(r: dict[str, Any]) -> str:
    if r["system"].startswith("single-"):
        return "single-t1" if r["threads"] == 1 else "single-tN"
    return r["system"]


def common_args(cfg: Config) -> list[str]:
    return [
        "--batch",
        str(cfg.batch),
        "--image",
        str(cfg.image),
        "--warmup",
        str(cfg.warmup),
        "--batches",
        str(cfg.batches),
    ]


def run_baseline(cfg: Config) -> list[Run]:
    port, counts = str(free_port()), ",".join(map(str, cfg.counts))
    argvs = {
        f"rank{r}": python(
            "baseline_pipeline.py",
            "--rank",
            str(r),
            "--port",
            port,
            "--micro-batches",
            counts,
            *common_args(cfg),
        )
        for r in range(3)
    }
    names = {"rank0": "master", "rank1": "stage0", "rank2": "stage1"}
    return run_world(cfg, "baseline", argvs, names, thread_env(cfg.stage_threads))


def run_pipelining(cfg: Config, schedules: list[str]) -> list[Run]:
    port, counts = str(free_port()), ",".join(map(str, cfg.counts))
    argvs = {
        f"rank{r}": python(
            "references.py",
            "pipelining",
            "--rank",
            str(r),
            "--port",
            port,
            "--schedules",
            ",".join(schedules),
            "--micro-batches",
            counts,
            *common_args(cfg),
        )
        for r in range(2)
    }
    names = {"rank0": "stage0", "rank1": "stage1"}
    return run_world(cfg, "pipelining", argvs, names, thread_env(cfg.stage_threads))


def run_single(cfg: Config, threads: int) -> list[Run]:
    argvs = {"single": python("references.py", "single", *common_args(cfg))}
    return run_world(cfg, "single", argvs, {"single": "single"}, thread_env(threads))


# ---------------------------------------------------------------------------- the report


def best(runs: list[Run]) -> dict[str, tuple[int, list[Run]]]:
    """Per system: its best micro-batch count by median rate, and that count's runs."""
    by: dict[str, dict[int, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        by[r.system][r.m].append(r)
    chosen = {}
    for system, counts in by.items():
        m = max(counts, key=lambda k: spread([r.rate for r in counts[k]])[1])
        chosen[system] = (m, counts[m])
    return chosen


def median_rate(runs: list[Run]) -> float:
    return spread([r.rate for r in runs])[1]


def report(runs: list[Run], cpus: int) -> str:
    lines = ["", "samples/s by micro-batch count: median [min-max] over repeats"]
    by: dict[str, dict[int, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        by[r.system][r.m].append(r)
    for system in by:
        cells = [
            f"m={m}: {_spread(by[system][m])}" + _chose(by[system][m])
            for m in sorted(by[system], key=str)
        ]
        lines.append(f"  {system:<20} " + "   ".join(cells))
    chosen = best(runs)
    single = chosen.get("single-t1")
    lines += [
        "",
        "at each system's best count:",
        f"  {'system':<20} {'m':>2} {'samples/s':>20} {'s/batch':>7} {'vs 1 thread':>11}"
        f" {'lost':>5} {'bubble':>6} {'per CPU-s':>9}",
        "      per process: CPU/wall, page faults/batch, busiest threads CPU-s/batch",
    ]
    for system in chosen:
        m, rs = chosen[system]
        rate = median_rate(rs)
        speedup = rate / median_rate(single[1]) if single else float("nan")
        usable = 1 if system == "single-t1" else cpus  # cores it can keep busy
        lost = 1 - speedup / usable if single else float("nan")
        bubbles = [r.bubble for r in rs if r.bubble is not None]
        bubble = f"{spread(bubbles)[1]:>6.0%}" if bubbles else f"{'-':>6}"
        per_cpu = _per_cpu(rs)
        m = "/".join(sorted({str(r.chosen) for r in rs})) if m == AUTO else m
        lines.append(
            f"  {system:<20} {m:>2} {_spread(rs):>20} {rs[0].batch / rate:>7.2f}"
            f" {speedup:>10.2f}x {lost:>5.0%} {bubble} {per_cpu:>9.1f}"
        )
        lines += _processes(rs)
    lines += ["", "ratios (targets of issue 6):"]
    rate = {s: median_rate(rs) for s, (_, rs) in chosen.items()}

    def ratio(a: str, b: str, target: float | None = None, label: str | None = None) -> None:
        if a in rate and b in rate:
            r = rate[a] / rate[b]
            goal = f"   target >= {target}x: {'met' if r >= target else 'missed'}" if target else ""
            lines.append(f"  {label or f'{a} / {b}':<44} {r:>5.2f}x{goal}")

    for variant in (s for s in rate if ":" in s):
        base = variant.partition(":")[0]
        ratio(base, variant, None, f"{base} / {variant} (a lever's gain)")
    lines += _per_cpu_against_torch(chosen)
    for before in (s for s in rate if s.startswith("pipejob@")):
        ratio("pipejob", before, 0.95, f"pipejob / {before} (today against then)")
        lines += _same_results(runs, before)
    if "pipejob" in chosen:
        ratio(
            "pipejob-auto",
            "pipejob",
            None,
            f"pipejob-auto / pipejob at its best m ({chosen['pipejob'][0]})",
        )
    for system in (s for s in ENGINES if s in rate):
        ratio(system, "pipejob", None, f"{system} / pipejob (the engines)")
    ratio("pipejob", "baseline", 1.3)
    ratio("pipejob-eager", "baseline", 1.0, "pipejob-eager / baseline (issue 56)")
    if "gpipe" in rate or "1f1b" in rate:
        better = max((s for s in ("gpipe", "1f1b") if s in rate), key=rate.get)
        ratio("pipejob", better, 1.2, f"pipejob / better of GPipe, 1F1B ({better})")
    ratio("pipejob", "single-t1", 1.5)
    ratio("single-tN", "single-t1", None, f"single-tN / single-t1 (the {cpus}-core limit)")
    ratio("baseline", "single-t1")
    for s in ("gpipe", "1f1b"):
        ratio(s, "single-t1")
    lines += [
        "",
        "lost = 1 - (speed-up over one thread) / (cores it can use); bubble = pipejob's"
        " own measure (idle share of stage time in forward and backward); per CPU-s ="
        " samples per CPU-second of all its processes (robust to other load).",
    ]
    return "\n".join(lines)


def _per_cpu_against_torch(chosen: dict[str, tuple[int, list[Run]]]) -> list[str]:
    """Each pipejob system's samples per CPU-second over torch's best schedule's (GPipe or
    1F1B, the better per CPU-second), each at its best count: issue 61's line is above 1."""
    per = {s: _per_cpu(rs) for s, (_, rs) in chosen.items()}
    torch_best = max((s for s in ("gpipe", "1f1b") if s in per), key=per.get, default=None)
    if torch_best is None:
        return []
    lines = [f"  per CPU-second, over torch's best ({torch_best}, {per[torch_best]:.1f}):"]
    for system in (s for s in per if s.startswith("pipejob")):
        lines.append(f"    {system:<42} {per[system] / per[torch_best]:>5.2f}x")
    return lines


def _per_cpu(runs: list[Run]) -> float:
    """The median over runs of samples per CPU-second of all a run's processes."""
    return spread([r.batch * r.batches / sum(d.cpu for d in r.processes.values()) for r in runs])[1]


def _same_results(runs: list[Run], label: str) -> list[str]:
    """Where each cut the model, and whether the same steps at the same micro-batch count
    gave the same losses (the same model, seed and data: they must)."""
    now = {r.m: r for r in runs if r.system == "pipejob"}
    then = {r.m: r for r in runs if r.system == label}
    lines = []
    for m in sorted(set(now) & set(then), key=str):
        a, b = now[m], then[m]
        same = len(a.losses) == len(b.losses) and all(
            abs(x - y) <= 1e-5 * max(abs(y), 1) for x, y in zip(a.losses, b.losses, strict=True)
        )
        lines += [
            f"    m={m}: cut: pipejob stage 1 begins at {a.cut}; {label} at {b.cut}",
            f"    m={m}: losses: pipejob {', '.join(f'{x:.5f}' for x in a.losses)};"
            f" {label} {', '.join(f'{x:.5f}' for x in b.losses)}:"
            f" {'the same' if same else 'DIFFERENT'}",
        ]
    return lines


def _chose(runs: list[Run]) -> str:
    """What `microBatches: auto` chose in each of these runs."""
    if runs[0].m != AUTO:
        return ""
    return f" (chose {', '.join(str(r.chosen) for r in runs)})"


def _spread(runs: list[Run]) -> str:
    lo, mid, hi = spread([r.rate for r in runs])
    return f"{mid:.1f} [{lo:.1f}-{hi:.1f}]"


def _processes(runs: list[Run]) -> list[str]:
    """Per process of the median run: CPU/wall, faults and busiest threads per batch."""
    run = sorted(runs, key=lambda r: r.rate)[len(runs) // 2]
    out = []
    for name, d in sorted(run.processes.items()):
        faults = d.minflt / run.batches
        out.append(
            f"      {name:<8} CPU/wall {d.cpu / run.wall:4.2f}  faults/batch {faults:>7.0f}"
            f"  {threads_summary(d, run.batches)}"
        )
    out.append(f"      ({run.load} at the end of this run)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--micro-batches", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=4, help="measured batches per run")
    ap.add_argument("--warmup", type=int, default=1, help="batches left out per run")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="one repeat, m=2,4, 2 batches")
    ap.add_argument(
        "--pipejob-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the pipejob run (e.g. PIPEJOB_TUNING=off)",
    )
    ap.add_argument(
        "--pipejob-variant",
        action="append",
        default=[],
        metavar="LABEL:KEY=VALUE",
        help="also run each pipejob system asked for with this environment, reported as"
        " SYSTEM:LABEL (e.g. off:PIPEJOB_TUNING=off); interleaved with the others",
    )
    ap.add_argument(
        "--stage-threads",
        type=int,
        help="threads of each baseline and torch.distributed.pipelining process (default:"
        " the run's cores over its 2 stage processes, at least 1; with more than 1, their"
        " OpenMP teams wait passively)",
    )
    ap.add_argument(
        "--cores",
        help="comma-separated core counts to sweep (e.g. 2,4,8,16): each count's runs get the"
        " first N CPUs of this process's affinity (default: all of them, one count)",
    )
    ap.add_argument(
        "--at",
        metavar="REV",
        help="also run pipejob as it was at this git"
        " revision (pipejob@REV): speed, cut and losses side by side",
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds per world")
    ap.add_argument("--json", type=Path, help="also write every run here")
    ap.add_argument("--verbose", action="store_true", help="relay every process's output")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.micro_batches, args.batches = 1, "2,4", 2
    systems = [s.strip() for s in args.systems.split(",")]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown system(s) {', '.join(sorted(unknown))}; choose from {SYSTEMS}")
    mine = sorted(os.sched_getaffinity(0))
    try:
        sweep = [int(n) for n in args.cores.split(",")] if args.cores else [len(mine)]
    except ValueError:
        ap.error(f"--cores {args.cores!r}: comma-separated whole numbers, e.g. 2,4,8,16")
    if any(n < 1 for n in sweep):
        ap.error(f"--cores {args.cores!r}: each count must be at least 1")
    for n in [n for n in sweep if n > len(mine)]:
        say(f"--cores: leaving out {n}: this process may use {len(mine)} CPUs")
    sweep = [n for n in sweep if n <= len(mine)]
    cfg = Config(
        args.batch,
        args.image,
        [int(m) for m in args.micro_batches.split(",")],
        args.warmup,
        args.batches,
        dict(kv.split("=", 1) for kv in args.pipejob_env),
        variants(args.pipejob_variant),
        args.stage_threads or 0,
        args.timeout,
        args.verbose,
    )
    say(
        f"compare: ResNet-50, batch {cfg.batch}, {cfg.image}x{cfg.image}, micro-batches"
        f" {cfg.counts}, {args.repeats} repeat(s) of {cfg.batches} measured batches after"
        f" {cfg.warmup} warm-up; {machine()}; {time.strftime('%Y-%m-%d %H:%M')}"
    )
    if cfg.pipejob_env:
        say(f"pipejob env: {cfg.pipejob_env}")
    runs: list[Run] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pipejob-compare-") as tmp:
        before = str(checkout(args.at, Path(tmp) / "at")) if args.at else ""
        for cores in sweep:
            with pinned(mine[:cores]):
                # Each of the two stage processes of the baseline and pipelining its share.
                threads = args.stage_threads or max(1, cores // 2)
                say(
                    f"\n{cores} cores (CPUs {_cpu_list(mine[:cores])}): baseline and pipelining"
                    f" {threads} thread(s) per process, single-tN {cores}"
                )
                new = measure(
                    replace(cfg, stage_threads=threads),
                    systems,
                    args.repeats,
                    Path(tmp),
                    args.at,
                    before,
                    cores,
                    started,
                )
            runs += new
            say(report(new, cores))
    if args.json:
        args.json.write_text(json.dumps([_jsonable(r) for r in runs], indent=1))
    if len(sweep) > 1:
        say(trend(runs, sweep))
    say(f"\ntotal {time.monotonic() - started:.0f}s; {machine()}")
    return 0


def measure(
    cfg: Config,
    systems: list[str],
    repeats: int,
    tmp: Path,
    at: str | None,
    before: str,
    cores: int,
    started: float,
) -> list[Run]:
    """Every system at every micro-batch count, `repeats` times, interleaved; on `cores`."""
    runs: list[Run] = []
    schedules = [s for s in ("gpipe", "1f1b") if s in systems]
    for repeat in range(1, repeats + 1):
        jobs: list[tuple[str, Any]] = []
        if "pipejob" in systems:
            jobs.append(("pipejob", lambda: run_pipejob(cfg, tmp)))
        if "pipejob-auto" in systems:
            jobs.append(("pipejob-auto", lambda: run_pipejob(cfg, tmp, "pipejob-auto")))
        if at:
            jobs.append(
                (
                    f"pipejob@{at}",
                    lambda: run_pipejob(cfg, tmp, f"pipejob@{at}", {"PYTHONPATH": before}),
                )
            )
        # Each variant runs every pipejob system asked for (the rpc engine's where none is).
        bases = [s for s in ("pipejob", *ENGINES) if s in systems] or ["pipejob"]
        for label, extra in cfg.variants.items():
            for name in (f"{base}:{label}" for base in bases):
                jobs.append(
                    (name, lambda name=name, extra=extra: run_pipejob(cfg, tmp, name, extra))
                )
        for system in (s for s in ENGINES if s in systems):
            jobs.append((system, lambda system=system: run_pipejob(cfg, tmp, system)))
        if "baseline" in systems:
            jobs.append(("baseline", lambda: run_baseline(cfg)))
        if schedules:
            jobs.append(("+".join(schedules), lambda: run_pipelining(cfg, schedules)))
        if "single-t1" in systems:
            jobs.append(("single-t1", lambda: run_single(cfg, 1)))
        if "single-tN" in systems and cores > 1:  # on one core it is single-t1
            jobs.append((f"single-t{cores}", lambda: run_single(cfg, cores)))
        for label, job in jobs:
            t0 = time.monotonic()
            say(
                f"[{time.monotonic() - started:5.0f}s] {cores} cores, repeat {repeat}/{repeats}:"
                f" {label} ..."
            )
            try:
                new = job()
            except (RuntimeError, TimeoutError) as e:  # the others are still measured
                say(f"          {label} FAILED, left out of the tables: {e}")
                continue
            for r in new:
                r.cores = cores
            runs += new
            rates = ", ".join(f"{r.system} m={r.m}{_chose([r])} {r.rate:.1f}" for r in new)
            say(f"          {rates} samples/s ({time.monotonic() - t0:.0f}s; {load_average()})")
    return runs


@contextmanager
def pinned(cpus: list[int]) -> Iterator[None]:
    """This process, and every process it starts meanwhile, on `cpus` only (children inherit
    the affinity; pipejob's tuning derives its threads from it)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _cpu_list(cpus: list[int]) -> str:
    return f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else str(cpus)


def trend(runs: list[Run], sweep: list[int]) -> str:
    """Each system at its best micro-batch count, and the issues' ratios, per core count."""
    rates: dict[int, dict[str, float]] = {}
    for cores in sweep:
        chosen = best([r for r in runs if r.cores == cores])
        rates[cores] = {s: median_rate(rs) for s, (_, rs) in chosen.items()}
    systems = list(dict.fromkeys(s for by in rates.values() for s in by))
    head = f"  {'':<44}" + "".join(f" {f'{n} cores':>9}" for n in sweep)
    lines = ["", "across core counts: samples/s at each system's best count (median)", head]
    for system in systems:
        cells = "".join(
            f" {rates[n][system]:>9.1f}" if system in rates[n] else f" {'-':>9}" for n in sweep
        )
        lines.append(f"  {system:<44}{cells}")

    def better_pipelining(by: dict[str, float]) -> str | None:
        found = [s for s in ("gpipe", "1f1b") if s in by]
        return max(found, key=by.__getitem__) if found else None

    ratios = [
        ("pipejob / better of GPipe, 1F1B (>= 1.2x)", "pipejob", better_pipelining),
        ("pipejob-auto / pipejob at its best (>= 0.9x)", "pipejob-auto", lambda by: "pipejob"),
        ("pipejob / baseline", "pipejob", lambda by: "baseline"),
        ("pipejob / single-tN", "pipejob", lambda by: "single-tN"),
        ("single-tN / single-t1", "single-tN", lambda by: "single-t1"),
    ]
    lines.append("  ratios:")
    for label, a, against in ratios:
        cells = ""
        for n in sweep:
            b = against(rates[n])
            ok = a in rates[n] and b in rates[n]
            cells += f" {rates[n][a] / rates[n][b]:>8.2f}x" if ok else f" {'-':>9}"
        lines.append(f"  {label:<44}{cells}")
    return "\n".join(lines)


def variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """ "off:PIPEJOB_TUNING=off" -> {"off": {"PIPEJOB_TUNING": "off"}} (KEY=VALUE may repeat,
    comma-free: "a:K=V" per flag; the same label twice merges)."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        label, _, assignment = spec.partition(":")
        key, _, value = assignment.partition("=")
        out.setdefault(label, {})[key] = value
    return out


def _jsonable(r: Run) -> dict[str, Any]:
    d = dict(r.__dict__)
    d["processes"] = {n: c.__dict__ for n, c in r.processes.items()}
    return d


if __name__ == "__main__":
    sys.exit(main())
