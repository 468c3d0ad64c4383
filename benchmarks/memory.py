"""How much memory each process of a PipelineJob holds against its share of the model
(issue 20: no process should hold more than its own stage).

pipejob's transformer (default 24 layers of width 1024, about 302M parameters, 1.21 GB in
float32) at 4 stages, SGD, 2 steps, through the local runner (`pipejob run` on a manifest
written to a temporary folder). Every process's peak resident memory (VmHWM) comes from the
master's summary (pipejob.trainer.runtime.memory, asked of every member at the end); each
stage's share of the model is counted from its layers (the summary's partition) on a copy of
the model built on the meta device, which holds no memory. Printed: each process's peak, its
share, and their ratios, against the whole model too.

--large also runs a model about three times larger (72 layers) at 8 stages. By default it is
skipped, saying why: the run above, scaled by three, against this machine's available memory.

    python benchmarks/memory.py                  # a few minutes on 2 cores
    python benchmarks/memory.py --large          # and the 3x model at 8 stages
    python benchmarks/memory.py --layers 2 --width 64 --heads 4 --stages 2   # a smoke test
    python benchmarks/memory.py --tuning threads,transport   # without the allocator lever
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from _common import machine, run_job

GB = 1e9


def manifest(args: argparse.Namespace, layers: int, stages: int) -> dict[str, Any]:
    transformer = {
        "vocabSize": args.vocab,
        "layers": layers,
        "width": args.width,
        "heads": args.heads,
        "seqLen": args.seq_len,
    }
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": f"memory-{layers}x{args.width}-{stages}"},
        "spec": {
            "model": {"transformer": transformer},
            "stages": stages,
            "batchSize": args.batch,
            "microBatches": args.micro_batches,
            "steps": args.steps,
            "logEvery": 1,
            "seed": 0,
            "optimizer": {"name": "sgd", "lr": 0.01},
            "preflight": {"enabled": False},
            "rendezvousTimeoutSeconds": 600,
        },
    }


def parameter_bytes(args: argparse.Namespace, layers: int) -> dict[str, int]:
    """Bytes of each parameter of the transformer, by name, from a build on the meta device
    (shapes only: nothing is allocated)."""
    import torch

    from pipejob.core.workload import Transformer
    from pipejob.trainer.workloads.transformer import TransformerLM

    spec = Transformer(
        vocab_size=args.vocab,
        layers=layers,
        width=args.width,
        heads=args.heads,
        seq_len=args.seq_len,
    )
    with torch.device("meta"):
        model = TransformerLM(spec)
    return {name: p.numel() * p.element_size() for name, p in model.named_parameters()}


def share(sizes: dict[str, int], units: list[str]) -> int:
    """Bytes of the parameters under the modules named `units` (a stage's layers)."""
    return sum(
        b for name, b in sizes.items() if any(name == u or name.startswith(u + ".") for u in units)
    )


def measure(args: argparse.Namespace, layers: int, stages: int, tmp: Path) -> dict[str, Any]:
    """Run the job; print and return every member's peak against its share of the model."""
    job = manifest(args, layers, stages)
    stem = tmp / job["metadata"]["name"]
    env = dict(os.environ) | ({"PIPEJOB_TUNING": args.tuning} if args.tuning else {})
    summary, _, _ = run_job(job, stem, "memory", args.steps, 1, args.timeout, env)
    sizes = parameter_bytes(args, layers)
    whole = sum(sizes.values())
    peaks: dict[str, dict[str, int]] = summary["memory"]
    shares = {st["stage"]: share(sizes, st["layers"]) for st in summary["partition"]}
    print(
        f"\ntransformer {layers} layers x width {args.width}, {args.heads} heads, sequence"
        f" {args.seq_len}, vocabulary {args.vocab}: {whole / 4 / 1e6:.0f}M parameters,"
        f" {whole / GB:.2f} GB in float32; {stages} stages, SGD, {args.steps} steps,"
        f" {summary['secondsPerStep']:.3f} s/step"
        f" (PIPEJOB_TUNING={args.tuning or 'on'})"
    )
    print(
        f"  {'process':<8} {'peak RSS GB':>11} {'share GB':>9} {'peak/share':>10}"
        f" {'peak/model':>10}"
    )
    for member, figures in peaks.items():
        rss = figures["rssPeakBytes"]
        own = shares.get(member, 0)
        ratio = f"{rss / own:>9.2f}x" if own else f"{'-':>10}"
        print(f"  {member:<8} {rss / GB:>11.2f} {own / GB:>9.2f} {ratio} {rss / whole:>9.2f}x")
    total = sum(f["rssPeakBytes"] for f in peaks.values())
    print(
        f"  {'all':<8} {total / GB:>11.2f} {whole / GB:>9.2f} {total / whole:>9.2f}x"
        f" {total / whole:>9.2f}x"
    )
    master = peaks["master"]["rssPeakBytes"]
    tightest = max((m for m in peaks if m in shares), key=lambda m: peaks[m]["rssPeakBytes"])
    print(
        f"  master {master / GB:.2f} GB ({master / whole:.2f}x the model); the tightest stage"
        f" {tightest} {peaks[tightest]['rssPeakBytes'] / GB:.2f} GB"
    )
    return {"whole": whole, "total": total}


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise LookupError("no MemAvailable in /proc/meminfo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument(
        "--large",
        action="store_true",
        help="also run a model three times larger at twice the stages",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument(
        "--tuning",
        default="",
        help="PIPEJOB_TUNING for the runs, e.g. threads,transport: no allocator"
        " lever, less memory for slower steps",
    )
    args = parser.parse_args()
    print(f"machine: {machine()}, {available_bytes() / GB:.1f} GB available")
    with tempfile.TemporaryDirectory(prefix="pipejob-memory-") as tmp:
        first = measure(args, args.layers, args.stages, Path(tmp))
        layers, stages = 3 * args.layers, 2 * args.stages
        need, have = 3 * first["total"], available_bytes()
        if args.large:
            measure(args, layers, stages, Path(tmp))
        else:
            why = (
                f"it may not fit: up to {need / GB:.1f} GB, {have / GB:.1f} GB available"
                if need > have
                else f"it may fit ({need / GB:.1f} GB of {have / GB:.1f} GB available), but"
                f" {stages + 1} processes on {os.cpu_count()} cores take long"
            )
            print(
                f"\nskipped: {layers} layers at {stages} stages (--large runs it). The run"
                f" above held {first['total'] / GB:.1f} GB in all; three times the model:"
                f" {why}"
            )


if __name__ == "__main__":
    main()
