"""Checkpoints that reshard: pipejob's files keyed by the model's own names against
torch.distributed.checkpoint (DCP), on pipejob's transformer of 24 blocks of width 1024
(303M parameters, 1.21 GB in float32) with SGD momentum (another 1.21 GB of state).

The world that saves is cut in `--save-stages` stages of whole blocks (the embedding with the
first, the head with the last), the world that loads in `--load-stages`: each stage of it
loads its own names, parameters and momentum, from the files of the stages that held them.
Each save and each load runs in a process of its own, as a stage does, holding its shard (and
its optimizer state) before the clock starts; printed per format: seconds and the extra peak
resident memory (VmHWM reset just before, less the resident set then; and the peak of its
anonymous memory, sampled every 2 ms) of the slowest and the largest stage, and the bytes on
disk. Load times are with the page cache warm (the files were
just written; nothing here drops the machine's caches).

- pipejob: one file per stage, `runtime/checkpoint.py`'s save_module (torch.save straight to
  the file, atomic, SHA-256 in the manifest), the master's verify of every file (once), and
  load_named (the files memory-mapped, each name copied in).
- DCP: each stage's `dcp.save` of {model, optim} to a directory of its own, with no process
  group (the RPC engine has none spanning the stages); a loading stage `dcp.load`s its names,
  in place, from each directory that holds any (DefaultLoadPlanner(allow_partial_load=True)).

    python benchmarks/checkpoint.py                           # a few minutes on 2 cores
    python benchmarks/checkpoint.py --layers 2 --width 64     # a smoke test
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import fmt_spread, machine

GB = 1e9
FORMATS = ("pipejob", "dcp")


def units(layers: int, stages: int) -> list[list[str]]:
    """Each stage's modules: whole blocks, as even as they divide; the embedding on the
    first, the final norm and head on the last."""
    bounds = [k * layers // stages for k in range(stages + 1)]
    out = [[f"blocks.{b}" for b in range(bounds[k], bounds[k + 1])] for k in range(stages)]
    out[0].insert(0, "embed")
    out[-1] += ["norm", "head"]
    return out


def shard(args: argparse.Namespace, names: list[str], seed: int, trained: bool) -> Any:
    """A stage's module holding the model's `names` under their own names, with random
    weights, and an SGD optimizer: with its momentum filled (`trained`, a stage that saves),
    or fresh (a stage that resumes: its state is what it loads)."""
    import torch
    from torch import nn

    from pipejob.core.workload import Transformer
    from pipejob.trainer.workloads.transformer import TransformerLM

    spec = Transformer(
        vocab_size=256, layers=args.layers, width=args.width, heads=args.heads, seq_len=32
    )
    with torch.device("meta"):
        whole = TransformerLM(spec)
    root = nn.Module()
    for name in names:
        *parents, last = name.split(".")
        holder = root
        for part in parents:
            if not hasattr(holder, part):
                holder.add_module(part, nn.Module())
            holder = getattr(holder, part)
        holder.add_module(last, whole.get_submodule(name).to_empty(device="cpu"))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(root.parameters(), lr=0.1, momentum=0.9)
    with torch.no_grad():
        for p in root.parameters():
            p.normal_(generator=generator)
            if trained:
                optimizer.state[p]["momentum_buffer"] = torch.randn(p.shape, generator=generator)
    return root, optimizer


def _dcp_state(module: Any, optimizer: Any) -> dict[str, Any]:
    """{model, optim} by the model's own names: what a stage gives DCP to save, or to load
    into (a fresh optimizer's state made first, as DCP loads in place)."""
    import torch

    for p in module.parameters():
        if "momentum_buffer" not in optimizer.state[p]:
            optimizer.state[p]["momentum_buffer"] = torch.empty_like(p)
    names = {id(p): n for n, p in module.named_parameters()}
    optim = {names[id(p)]: s["momentum_buffer"] for p, s in optimizer.state.items()}
    return {"model": module.state_dict(), "optim": optim}


def op(args: argparse.Namespace) -> dict[str, float]:
    """One stage's save or load, in this process; its seconds and extra peak memory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from pipejob.trainer.runtime import checkpoint, memory, state_by_name

    root = Path(args.dir) / args.format
    if args.op == "verify":  # pipejob's master, once: every file's SHA-256 against the manifest
        start = time.perf_counter()
        assert isinstance(checkpoint.verify(checkpoint.step_dir(root, 1)), checkpoint.Checkpoint)
        return {"seconds": time.perf_counter() - start, "extra": 0, "anon": 0}
    stages = args.save_stages if args.op == "save" else args.load_stages
    names = units(args.layers, stages)[args.stage]
    module, optimizer = shard(args, names, seed=args.stage, trained=args.op == "save")
    before, anon_before = (memory.status_kb(f) * 1024 for f in ("VmRSS", "RssAnon"))
    anon = Sampler(lambda: memory.status_kb("RssAnon") * 1024)
    memory.reset_peak()
    start = time.perf_counter()
    if args.op == "save" and args.format == "pipejob":
        directory = checkpoint.step_dir(root, 1)
        entry = checkpoint.save_module(
            directory, f"stage{args.stage}.pt", module, {"optimizer": optimizer}
        )
        out = {"entry": entry}
    elif args.op == "save":
        dcp.save(_dcp_state(module, optimizer), checkpoint_id=str(root / f"stage{args.stage}"))
        out = {}
    elif args.format == "pipejob":
        directory = checkpoint.step_dir(root, 1)  # the master verified it (the "verify" row)
        manifest = json.loads((directory / checkpoint.MANIFEST).read_text())
        found = checkpoint.Checkpoint(1, directory, manifest)
        wanted = list(module.state_dict())
        entries = state_by_name.sources(found, state_by_name.index_of(found), wanted)
        state_by_name.load_named(found.directory, entries, module, {"optimizer": optimizer})
        out = {"files": len(entries)}
    else:
        state = _dcp_state(module, optimizer)
        held = json.loads((root / "held.json").read_text())
        read = 0
        for directory, keys in held.items():
            mine = {
                part: {k: v for k, v in state[part].items() if k in keys}
                for part in ("model", "optim")
            }
            if any(mine.values()):
                dcp.load(
                    mine,
                    checkpoint_id=directory,
                    planner=DefaultLoadPlanner(allow_partial_load=True),
                )
                read += 1
        out = {"files": read}
    seconds = time.perf_counter() - start
    peak = memory.status_kb("VmHWM") * 1024
    return {"seconds": seconds, "extra": peak - before, "anon": anon.stop() - anon_before, **out}


class Sampler:
    """The largest value `read` gave, read every 2 ms in a thread until `stop`: the peak of
    what VmHWM does not keep apart (anonymous memory, not a file's pages mapped in)."""

    def __init__(self, read: Any):
        self.read, self.peak, self.done = read, read(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.002):
            self.peak = max(self.peak, self.read())

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.peak, self.read())


def run_op(args: argparse.Namespace, what: str, fmt: str, stage: int, directory: Path) -> dict:
    argv = [
        sys.executable,
        __file__,
        "--op",
        what,
        "--format",
        fmt,
        "--stage",
        str(stage),
        "--dir",
        str(directory),
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
        "--heads",
        str(args.heads),
        "--save-stages",
        str(args.save_stages),
        "--load-stages",
        str(args.load_stages),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{what} {fmt} stage {stage} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def one_repeat(args: argparse.Namespace, fmt: str, tmp: Path) -> dict[str, Any]:
    """Save with one cut, load with another; every stage's figures."""
    from pipejob.trainer.runtime import checkpoint

    directory = tmp / fmt
    saved = [run_op(args, "save", fmt, k, tmp) for k in range(args.save_stages)]
    if fmt == "pipejob":  # the master's manifest, as a PipelineJob's writes it
        checkpoint.write_manifest(directory, 1, [s["entry"] for s in saved], kind="bench")
    else:  # which directory holds which names: what pipejob's index says, for DCP's loads
        held = {str(directory / f"stage{k}"): _names(args, k) for k in range(args.save_stages)}
        (directory / "held.json").write_text(json.dumps(held))
    on_disk = size_of(directory)
    checked = [run_op(args, "verify", fmt, 0, tmp)] if fmt == "pipejob" else []
    loaded = [run_op(args, "load", fmt, k, tmp) for k in range(args.load_stages)]
    return {"save": saved, "verify": checked, "load": loaded, "bytes": on_disk}


def _names(args: argparse.Namespace, stage: int) -> list[str]:
    module, _ = shard(args, units(args.layers, args.save_stages)[stage], seed=0, trained=False)
    return list(module.state_dict())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--save-stages", type=int, default=4)
    parser.add_argument("--load-stages", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved, per format")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per operation")
    parser.add_argument("--op", choices=("save", "verify", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--format", choices=FORMATS, help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.op is not None:
        print(json.dumps(op(args)))
        return
    print(f"machine: {machine()}")
    results: dict[str, list[dict[str, Any]]] = {fmt: [] for fmt in FORMATS}
    for _ in range(args.repeats):
        for fmt in FORMATS:  # interleaved: the machine's load falls on both
            with tempfile.TemporaryDirectory(prefix="pipejob-ckpt-", dir=".") as tmp:
                results[fmt].append(one_repeat(args, fmt, Path(tmp)))
    print(
        f"transformer {args.layers} blocks x width {args.width} with SGD momentum, saved by"
        f" {args.save_stages} stages, loaded by {args.load_stages} (each a process of its"
        f" own); {args.repeats} interleaved repeat(s), median [min-max]; {machine()}"
    )
    print(
        f"  {'format':<8} {'op':<6} {'slowest stage s':>16} {'sum of stages s':>16}"
        f" {'extra VmHWM GB':>16} {'extra anon GB':>16} {'on disk GB':>11}"
    )
    for fmt, repeats in results.items():
        for what in ("save", "verify", "load") if fmt == "pipejob" else ("save", "load"):
            slowest = [max(s["seconds"] for s in r[what]) for r in repeats]
            total = [sum(s["seconds"] for s in r[what]) for r in repeats]
            extra = [max(s["extra"] for s in r[what]) / GB for r in repeats]
            anon = [max(s["anon"] for s in r[what]) / GB for r in repeats]
            disk = f"{repeats[0]['bytes'] / GB:>11.2f}" if what == "save" else f"{'':>11}"
            print(
                f"  {fmt:<8} {what:<6} {fmt_spread(slowest, 2):>16} {fmt_spread(total, 2):>16}"
                f" {fmt_spread(extra, 2):>16} {fmt_spread(anon, 2):>16} {disk}"
            )
    print(
        "  extra: the largest stage's peak over what it held before (VmHWM counts the pages of"
        " a memory-mapped file it touched, which the kernel may drop; anon does not); a loading"
        " stage starts with a fresh optimizer, so its momentum, which both formats make, is in"
        " it; verify: pipejob's master checks every file's SHA-256 once before the stages load"
    )


if __name__ == "__main__":
    main()
