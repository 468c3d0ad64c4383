"""Data is not the bottleneck: the example PipelineJob on `imageFolder` data (PNG files decoded,
resized and normalised by DataLoader workers) beside the same job on `synthetic` data.

It writes an ImageFolder of PNG images (smooth random content, a colour per class: what a
photo's decoding costs, not noise that PNG cannot compress) into a temporary folder, then runs
the example's job (examples/resnet50-pipeline.yaml: model, stages, batchSize, imageSize,
numClasses, microBatches) through `pipejob run` with each source, interleaved `--repeats`
times. The rate is measured by wall clock between the master's step lines after the warm-up,
so it includes the time the master waits for a batch (the summary's samples/s does not: it
times the pipeline alone, and is printed beside it). Target: imageFolder at >= 0.9x the
samples/s of synthetic. It measures and prints; it asserts nothing.

    python benchmarks/data.py                       # about 4 minutes on 2 idle cores
    python benchmarks/data.py --write-only DIR      # only write the image folder (and keep it)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from _common import load_average, machine, run_job, spread

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "resnet50-pipeline.yaml"
SOURCES = ("synthetic", "imageFolder")


def write_image_folder(root: Path, classes: int, per_class: int, size: int, seed: int = 0) -> int:
    """`root/<class>/<k>.png`: `per_class` RGB images of size x size per class, each a random
    8x8 field smoothly upscaled plus its class's colour; the bytes written."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    colours = rng.uniform(40, 215, size=(classes, 3))
    written = 0
    for c in range(classes):
        folder = root / f"class{c:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            field = rng.normal(0, 40, size=(8, 8, 3)) + colours[c]
            small = Image.fromarray(np.clip(field, 0, 255).astype(np.uint8))
            image = small.resize((size, size), Image.Resampling.BICUBIC)
            path = folder / f"{k}.png"
            image.save(path)
            written += path.stat().st_size
    return written


def manifest(base: dict[str, Any], source: str, folder: Path, args: argparse.Namespace) -> dict:
    job = copy.deepcopy(base)
    job["metadata"]["name"] = f"data-{source.lower()}"
    spec = job["spec"]
    spec.update(steps=args.warmup + args.steps, logEvery=1, preflight={"enabled": False})
    if args.micro_batches:
        spec["microBatches"] = (
            args.micro_batches if args.micro_batches == "auto" else int(args.micro_batches)
        )
    if source == "imageFolder":
        spec["data"] = {"imageFolder": {"train": str(folder)}, "workers": args.workers}
    return job


def run(job: dict, tmp: Path, args: argparse.Namespace) -> dict[str, float]:
    name = job["metadata"]["name"]
    started = time.monotonic()
    summary, wall, _ = run_job(
        job, tmp / name, name, args.warmup + args.steps, args.warmup, args.timeout, dict(os.environ)
    )
    samples = job["spec"]["batchSize"] * job["spec"].get("replicas", 1) * args.steps
    return {
        "samplesPerSecond": samples / wall,  # wall clock: waiting for data included
        "pipelineSamplesPerSecond": summary["samplesPerSecond"],  # the pipeline's own time
        "microBatches": summary["microBatches"],
        "finalLoss": summary["finalLoss"],
        "seconds": time.monotonic() - started,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", type=Path, default=EXAMPLE, help="PipelineJob to start from")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out at the start")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--per-class", type=int, default=40, help="images per class")
    ap.add_argument("--source-size", type=int, help="the PNGs' size (default: imageSize)")
    ap.add_argument("--workers", type=int, default=2, help="spec.data.workers")
    ap.add_argument("--micro-batches", help="override the example's microBatches (a count, auto)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--write-only", type=Path, metavar="DIR", help="write the folder, run nothing")
    args = ap.parse_args()
    base = yaml.safe_load(args.manifest.read_text())
    spec = base["spec"]
    classes, size = spec.get("numClasses", 1000), spec.get("imageSize", 224)
    source_size = args.source_size or size

    def write(folder: Path) -> None:
        start = time.monotonic()
        written = write_image_folder(folder, classes, args.per_class, source_size)
        print(
            f"wrote {classes * args.per_class} PNG images of {source_size}x{source_size}"
            f" ({written / 1e6:.1f} MB) in {classes} classes to {folder}"
            f" in {time.monotonic() - start:.1f} s",
            flush=True,
        )

    if args.write_only:
        write(args.write_only)
        return 0
    print(
        f"data: {spec.get('model')}, {spec.get('stages', 2)} stages, batch"
        f" {spec.get('batchSize')}, {size}x{size}, {classes} classes, microBatches"
        f" {args.micro_batches or spec.get('microBatches')}; {args.repeats} repeat(s) of"
        f" {args.steps} measured steps after {args.warmup}; {machine()}",
        flush=True,
    )
    results: dict[str, list[dict[str, float]]] = {s: [] for s in SOURCES}
    with tempfile.TemporaryDirectory(prefix="pipejob-data-") as tmp:
        folder = Path(tmp) / "images"
        write(folder)
        for repeat in range(args.repeats):
            for source in SOURCES:  # interleaved: drift in the load hits both alike
                r = run(manifest(base, source, folder, args), Path(tmp), args)
                results[source].append(r)
                print(
                    f"  repeat {repeat + 1}: {source:<11} {r['samplesPerSecond']:.1f}"
                    f" samples/s by wall clock, {r['pipelineSamplesPerSecond']:.1f} in the"
                    f" pipeline (m={r['microBatches']}, final loss {r['finalLoss']:.3f},"
                    f" {r['seconds']:.0f} s with start-up; {load_average()})",
                    flush=True,
                )
    print(f"\n{'source':>11} {'samples/s (wall)':>24} {'samples/s (pipeline)':>24}")
    for source, rs in results.items():
        cells = [
            spread([r[k] for r in rs]) for k in ("samplesPerSecond", "pipelineSamplesPerSecond")
        ]
        print(
            f"{source:>11} "
            + " ".join(f"{f'{m:.1f} [{lo:.1f}-{hi:.1f}]':>24}" for lo, m, hi in cells)
        )
    ratio = statistics.median(r["samplesPerSecond"] for r in results["imageFolder"]) / (
        statistics.median(r["samplesPerSecond"] for r in results["synthetic"])
    )
    print(f"\nimageFolder / synthetic: {ratio:.2f}x the samples/s by wall clock (target >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
