"""The pipeline engines' own costs (issue 44): a model whose stages compute almost nothing
(`tiny`) and one that computes a little (`small`), in 2 and 4 stage processes, at micro-batch
counts 1 to 16, each step's seconds fitted as a fixed part plus a part per micro-batch (least
squares, with the fit's residual), for

  rpc                    pipejob's rpc engine (GPipe, each stage passing micro-batches on)
  gpipe, 1f1b, interleaved-1f1b, zero-bubble
                         pipejob's pipelining engine with that schedule
  torch-gpipe, torch-1f1b, torch-interleaved-1f1b
                         torch.distributed.pipelining's schedules driven directly over gloo
                         by the stage processes themselves (schedule.step, SGD's step,
                         zero_grad: no master), on the same pieces of the same cut
  torch-gpipe-loader     torch's GPipe as a user runs it: the first and last stages read
                         each step's batch from a DataLoader (torchtitan's way); its gap
                         to torch-gpipe is what the data path costs torch's loop (context
                         for pipejob's step, which reads and passes labels; not the line)

A micro-batch keeps its size (--samples samples), so the batch grows with the count: the
fixed part is what a step costs whatever its micro-batches (the master's calls, the norms,
the optimizer steps), the per-micro-batch part their forwards, backwards and transfers.
Every system runs in one world per stage count (the stage processes are pipejob's own, on
its pipelining engine's world; the rpc engine's stages are made in the same processes), and
at each count the systems take turns, --repeats times, each reported by its median, and each
pipejob system by its gap to torch's same schedule in the same turn (the gap the machine's
other work moves least; the rpc engine against torch's GPipe), fitted in turn. Then,
for pipejob's systems at one micro-batch, the master's profile of a step: which part of the
step each fixed cost is. It measures; it asserts nothing.

    python benchmarks/overhead.py                  # a few minutes on 2 cores
    python benchmarks/overhead.py --quick          # 2 stages, tiny, m=1,4,16
    python benchmarks/overhead.py --stages 4 --systems rpc,1f1b,torch-1f1b --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULT = "@@overhead "
# The transformer's fields (_overhead.MODELS has them too): 8 blocks, so 4 stages interleave
# 2 pieces each.
TINY = {"vocabSize": 16, "layers": 8, "width": 8, "heads": 1, "seqLen": 4}
PIPEJOB = ("rpc", "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
TORCH = ("torch-gpipe", "torch-1f1b", "torch-interleaved-1f1b")
# torch's GPipe as a user's loop runs it, its batches read from a DataLoader on the first and
# last stages: context for the data path pipejob's step has, never the yardstick (PARTNER).
USER_LOOP = ("torch-gpipe-loader",)
INTERLEAVED = ("interleaved-1f1b", "zero-bubble")
# The torch schedule each pipejob system is paired with, turn by turn (`gaps`).
PARTNER = {s: f"torch-{s}" for s in ("gpipe", "1f1b", "interleaved-1f1b")} | {
    "rpc": "torch-gpipe",
    "zero-bubble": "torch-interleaved-1f1b",
    "torch-gpipe-loader": "torch-gpipe",  # what the data path costs torch's loop
}


# ---------------------------------------------------------------------------- the world


def manifest(args: argparse.Namespace, stages: int) -> dict[str, Any]:
    """The world's job: the pipelining engine (its stage processes join a group), tiny."""
    optimizer: dict[str, Any] = {"name": "sgd", "lr": 0.01}
    if args.clip:
        optimizer["clipGradNorm"] = args.clip
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": f"overhead-{stages}"},
        "spec": {
            "model": {"transformer": TINY},
            "batchSize": 16,
            "microBatches": 1,
            "stages": stages,
            "engine": "pipelining",
            "schedule": "gpipe",
            "steps": 1,
            "seed": 0,
            "optimizer": optimizer,
            "preflight": {"enabled": False},
            "rendezvousTimeoutSeconds": 120,
        },
    }


def world(args: argparse.Namespace, stages: int) -> list[dict[str, Any]]:
    """Run one world: its stage processes serve, the master measures; its result lines."""
    from pipejob.core import plan, spec, tuning_levers
    from pipejob.runner.local import LOOPBACK, free_ports

    job = spec.parse(manifest(args, stages))
    rpc_port, ddp_port, preflight, monitor, group = free_ports(5)
    ports = plan.Ports(rpc_port, ddp_port, preflight, monitor, groups=(group,))
    processes = plan.plan_world(job, lambda m: LOOPBACK, ports)
    config = json.dumps({k: v for k, v in vars(args).items() if k != "json"} | {"stages": stages})
    popens = []
    try:
        for p in processes:
            env = os.environ | p.env | {"PYTHONUNBUFFERED": "1"}
            role = ["--drive", config] if p.role == "master" else ["--serve"]
            popens.append(
                subprocess.Popen(
                    [sys.executable, __file__, *role],
                    env=env | tuning_levers.preload_env(env),
                    text=True,
                    stdout=subprocess.PIPE if p.role == "master" else subprocess.DEVNULL,
                )
            )
        return _results(popens[0], args.timeout)
    finally:
        for popen in popens:
            if popen.poll() is None:
                popen.kill()
            popen.wait()


def _results(master: subprocess.Popen, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    results = []
    assert master.stdout is not None
    for line in master.stdout:
        if line.startswith(RESULT):
            results.append(json.loads(line[len(RESULT) :]))
            r = results[-1]
            if "seconds" in r:
                print(
                    f"  {r['stages']} stages {r['model']:>5} m={r['m']:<2} {r['system']:>22}:"
                    f" {r['seconds'] * 1e3:7.2f} ms/step (median; least"
                    f" {r['least'] * 1e3:.2f}), {r['cpu'] * 1e3:.2f} CPU-ms/step"
                    + (" at load {:.1f}-{:.1f}".format(*r["load"]) if "load" in r else ""),
                    flush=True,
                )
        else:
            print("  master | " + line.rstrip(), flush=True)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the world took longer than {timeout:g}s")
    if master.wait() != 0:
        sys.exit(f"the master failed (exit {master.returncode})")
    return results


def serve() -> None:
    """A stage process: the trainer's own stage role, with its performance settings."""
    from pipejob.trainer.runtime import tuning
    from pipejob.trainer.runtime.world import read_env

    env = read_env()
    tuning.apply(tuning.for_process(env.kind, env.role, env.rank, env.roles, env.gpus, os.environ))
    # As the trainer's entry point: gloo's deprecation chatter says nothing useful.
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
    from pipejob.trainer import pipeline

    pipeline.run(env)


# ---------------------------------------------------------------------------- the master


def drive(config: dict[str, Any]) -> None:
    """The master: every system at every count, in turns; then the profiles."""
    from pipejob.trainer.runtime import rendezvous, tuning
    from pipejob.trainer.runtime.world import read_env

    env = read_env()
    tuning.apply(tuning.for_process(env.kind, env.role, env.rank, env.roles, env.gpus, os.environ))
    import torch.distributed.rpc as rpc

    rendezvous.join_rpc(env)
    try:
        from _overhead import Bench

        Bench(env, config).run()
    finally:
        rpc.shutdown()


# ---------------------------------------------------------------------------- the report


def fit(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Least squares of seconds = fixed + per * m over (m, seconds): fixed, per, and the
    residual's root mean square."""
    n = len(points)
    if n < 2:
        return points[0][1], 0.0, 0.0
    mean_m = sum(m for m, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    var = sum((m - mean_m) ** 2 for m, _ in points)
    per = sum((m - mean_m) * (t - mean_t) for m, t in points) / var if var else 0.0
    fixed = mean_t - per * mean_m
    rms = (sum((t - fixed - per * m) ** 2 for m, t in points) / n) ** 0.5
    return fixed, per, rms


def table(results: list[dict[str, Any]], figure: str) -> str:
    """Per stage count, model and system: the fit in milliseconds of each count's `figure`
    (its median step, or its least: the step the machine's other work disturbed least),
    and each pipejob system's fixed and per-micro-batch parts against torch's best
    schedule's."""
    timed: dict[tuple[int, str, str], dict[int, list[float]]] = {}
    for r in results:
        if "seconds" in r:
            timed.setdefault((r["stages"], r["model"], r["system"]), {}).setdefault(
                r["m"], []
            ).append(r[figure])
    rows = [
        f"{'stages':>6} {'model':>5} {'system':>22} {'fixed ms':>9} {'per mb ms':>10}"
        f" {'resid ms':>9} {'fixed/torch':>12} {'per mb/torch':>13}  counts"
    ]
    fits: dict[tuple[int, str, str], tuple[float, float, float]] = {}
    for key, by_m in timed.items():
        fits[key] = fit(sorted((m, statistics.median(ts)) for m, ts in by_m.items()))
    for key in sorted(fits, key=lambda k: (k[0], k[1], _order(k[2]))):
        stages, model, system = key
        fixed, per, rms = fits[key]
        torch_fits = [f for k, f in fits.items() if k[:2] == key[:2] and k[2] in TORCH]
        best_fixed = min((f[0] for f in torch_fits), default=None)
        best_per = min((f[1] for f in torch_fits), default=None)
        ratios = f" {_ratio(fixed, best_fixed, system):>12} {_ratio(per, best_per, system):>13}"
        counts = ",".join(str(m) for m in sorted(timed[key]))
        rows.append(
            f"{stages:>6} {model:>5} {system:>22} {fixed * 1e3:>9.2f} {per * 1e3:>10.3f}"
            f" {rms * 1e3:>9.2f}{ratios}  {counts}"
        )
    return "\n".join(rows)


def gaps(results: list[dict[str, Any]], figure: str) -> str:
    """Per stage count, model and pipejob system: at each count, the median over the turns
    of its `figure` ("turns": the step, "turns_least": each turn's least step, "cpu_turns":
    CPU a step) minus that of torch's same schedule in the same turn (what the machine's
    other work moves least), in ms; and the fit of those gaps, its fixed and per-micro-batch
    parts: at most 0 is at torch's."""
    rows = [
        f"{'stages':>6} {'model':>5} {'system':>22} {'against':>22} {'fixed ms':>9}"
        f" {'per mb ms':>10} {'resid ms':>9}  each count's gap (m: ms)"
    ]
    paired = paired_gaps(results, figure)
    for key in sorted(paired, key=lambda k: (k[0], k[1], _order(k[2]))):
        stages, model, system = key
        fixed, per, rms = fit(paired[key])
        each = " ".join(f"{m}:{gap * 1e3:+.1f}" for m, gap in paired[key])
        rows.append(
            f"{stages:>6} {model:>5} {system:>22} {PARTNER[system]:>22} {fixed * 1e3:>9.2f}"
            f" {per * 1e3:>10.3f} {rms * 1e3:>9.2f}  {each}"
        )
    return "\n".join(rows)


def paired_gaps(
    results: list[dict[str, Any]], figure: str
) -> dict[tuple[int, str, str], list[tuple[int, float]]]:
    """Per stage count, model and pipejob system: (m, the median over the turns of its
    `figure` minus its torch partner's in the same turn) at each count both ran. Only the
    timed results count: a profiled step (at one micro-batch) has the same key."""
    by_turn = {
        (r["stages"], r["model"], r["m"], r["system"]): r[figure] for r in results if figure in r
    }
    paired: dict[tuple[int, str, str], list[tuple[int, float]]] = {}
    for (stages, model, m, system), turns in sorted(by_turn.items()):
        against = by_turn.get((stages, model, m, PARTNER.get(system, "")))
        if against:
            gap = statistics.median(a - b for a, b in zip(turns, against, strict=True))
            paired.setdefault((stages, model, system), []).append((m, gap))
    return paired


def verdict(results: list[dict[str, Any]], system: str = "gpipe") -> str:
    """Issue 61's line for `system` (the default engine's GPipe) at each stage count and
    model: its fixed cost a step at most torch's GPipe's + 1 ms and its cost per micro-batch
    at most torch's, by the fit of the turn-by-turn gaps (each turn's median step, and its
    least), with the load average the counts ran at."""
    lines = []
    medians, leasts = paired_gaps(results, "turns"), paired_gaps(results, "turns_least")
    for key in sorted(k for k in medians if k[2] == system):
        timed = [r for r in results if "load" in r and r["stages"] == key[0]]
        loads = [x for r in timed if (r["model"], r["system"]) == key[1:] for x in r["load"]]
        parts = []
        for name, paired in (("median", medians), ("least", leasts)):
            if key in paired and len(paired[key]) > 1:
                fixed, per, _ = fit(paired[key])
                ok = fixed <= 0.001 and per <= 0
                parts.append(
                    f"{name} {fixed * 1e3:+.2f} ms + {per * 1e3:+.3f} ms/mb"
                    f" ({'met' if ok else 'missed'})"
                )
        load = f"load {min(loads):.1f}-{max(loads):.1f}" if loads else "load not recorded"
        lines.append(f"  {key[0]} stages {key[1]} {system}: {'; '.join(parts)}; {load}")
    return "\n".join(lines)


def _ratio(value: float, torch_best: float | None, system: str) -> str:
    """A pipejob figure over torch's best; nothing for torch's own, 'n/a' where either fit
    is not positive (noise larger than the part)."""
    if system in (*TORCH, *USER_LOOP) or torch_best is None:
        return ""
    return f"{value / torch_best:.2f}x" if torch_best > 0 and value > 0 else "n/a"


def _order(system: str) -> int:
    every = [*PIPEJOB, *TORCH, *USER_LOOP]
    return every.index(system) if system in every else len(every)


def profiles(results: list[dict[str, Any]]) -> str:
    """The master's parts of a step at one micro-batch, per pipejob system."""
    lines = []
    for r in results:
        if "phases" in r:
            parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in r["phases"].items())
            lines.append(
                f"{r['stages']} stages {r['model']} {r['system']} m={r['m']}:"
                f" {parts}, between them {r['between'] * 1e3:.2f}"
                f" (of {r['span'] * 1e3:.2f} ms)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--micro-batches", default="1,2,4,8,16")
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--systems", default=",".join([*PIPEJOB, *TORCH, *USER_LOOP]))
    ap.add_argument("--samples", type=int, default=2, help="samples per micro-batch")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per turn")
    ap.add_argument("--warmup", type=int, default=1, help="steps left out per system and count")
    ap.add_argument("--repeats", type=int, default=6, help="turns of every system per count")
    ap.add_argument("--clip", type=float, default=None, help="optimizer.clipGradNorm")
    ap.add_argument("--no-profile", action="store_true", help="skip the master's profiles")
    ap.add_argument("--quick", action="store_true", help="2 stages, tiny, m=1,4,16, 1 repeat")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per world")
    ap.add_argument("--json", type=Path, help="also write every result here")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--drive", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve()
        return 0
    if args.drive:
        drive(json.loads(args.drive))
        return 0
    if args.quick:
        args.stages, args.models, args.micro_batches, args.repeats = "2", "tiny", "1,4,16", 1
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HERE), os.environ.get("PYTHONPATH")])
    )
    started = time.monotonic()
    print(
        f"engine overhead: stages {args.stages}, models {args.models}, micro-batches"
        f" {args.micro_batches} of {args.samples} samples, {args.repeats} turns of"
        f" {args.steps} steps; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
        " (a shared machine: compare ratios, not seconds)",
        flush=True,
    )
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pipejob-overhead-"):
        for stages in [int(s) for s in args.stages.split(",")]:
            results += world(args, stages)
    print("\nthe fit of each count's median step:\n" + table(results, "seconds"))
    print("\nthe fit of each count's least step (the least disturbed):\n" + table(results, "least"))
    print(
        "\nthe fit of each count's CPU seconds a step, every process of the system (pipejob's"
        " master too; the figure least moved by the machine's other work):"
    )
    print(table(results, "cpu"))
    print(
        "\npipejob over torch's same schedule in the same turn, the median of the turns (the"
        " figure the machine's other work moves least), and its fit (at most 0: at torch's):"
    )
    print("the step (each turn's median step):\n" + gaps(results, "turns"))
    print("the step (each turn's least step, the least disturbed):")
    print(gaps(results, "turns_least"))
    print("CPU a step, every process of the system:\n" + gaps(results, "cpu_turns"))
    print(
        "\nissue 61's line: the default engine's GPipe a step at most torch's GPipe + 1 ms,"
        " per micro-batch at most torch's (the fits of the gaps above):"
    )
    print(verdict(results))
    if not args.no_profile:
        print("\nthe master's profile of one step (ms):")
        print(profiles(results))
    print(f"\n{time.monotonic() - started:.0f} s in all")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
