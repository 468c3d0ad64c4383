"""Pipeline speed-up from micro-batching: the example PipelineJob at 1, 2, 4 and 8 micro-batches,
and with `microBatches: auto`.

Each configuration runs through the local runner (`pipejob run`, real processes on loopback)
and is measured by the master's own summary. Prints samples/s, the speed-up over the first
count beside the GPipe ideal p*m/(m+p-1), and the measured bubble beside the ideal
(p-1)/(m+p-1); for auto, the count it chose and how it compares with the best fixed count.
It measures; it asserts nothing about time.

    python benchmarks/pipeline.py                      # the example: 1, 2, 4, 8 and auto
    python benchmarks/pipeline.py --steps 20 --micro-batches 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from pipejob.core.kinds.pipeline_schedules import AUTO
from pipejob.core.spec import InvalidSpec, parse

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "resnet50-pipeline.yaml"
OVERRIDES = {  # flag -> spec field
    "model": "model",
    "stages": "stages",
    "batch_size": "batchSize",
    "image_size": "imageSize",
    "steps": "steps",
}


def run_one(manifest: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    """Run one manifest through `pipejob run`, relaying its progress; the master's summary."""
    m = manifest["spec"]["microBatches"]
    path, summary = workdir / f"m{m}.yaml", workdir / f"m{m}.json"
    path.write_text(yaml.safe_dump(manifest))
    popen = subprocess.Popen(
        [sys.executable, "-m", "pipejob.cli", "run", str(path)],
        env=os.environ | {"PIPEJOB_SUMMARY_FILE": str(summary)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for line in popen.stdout:
            lines.append(line)
            if any(f"master | {what}" in line for what in ("step", "stage", "microBatches")):
                print(f"  m={m}: {line.split('| ', 1)[1].strip()}", flush=True)
            if time.monotonic() > deadline:
                raise TimeoutError(f"m={m} took longer than {timeout:g}s")
        popen.wait(timeout=60)
    finally:
        if popen.poll() is None:
            popen.terminate()  # the runner stops its whole world on SIGTERM
            popen.wait(timeout=30)
    if popen.returncode != 0 or not summary.exists():
        sys.exit(f"m={m} failed (exit {popen.returncode}):\n" + "".join(lines[-40:]))
    return json.loads(summary.read_text())


def table(results: list[dict[str, Any]]) -> str:
    base = results[0]["samplesPerSecond"]
    p = results[0]["stages"]
    rows = [
        f"{'micro-batches':>13} {'samples/s':>10} {'speed-up':>9} {'GPipe ideal':>12}"
        f" {'bubble':>7} {'ideal bubble':>13}"
    ]
    for r in results:
        m = r["microBatches"]  # for auto: the count it chose
        label = f"auto: {m}" if r["microBatchesRequested"] == AUTO else str(m)
        rows.append(
            f"{label:>13} {r['samplesPerSecond']:>10.1f} {r['samplesPerSecond'] / base:>8.2f}x"
            f" {p * m / (m + p - 1):>11.2f}x {r['bubble']['measured']:>7.0%}"
            f" {r['bubble']['gpipeIdeal']:>13.0%}"
        )
    fixed = [r for r in results if r["microBatchesRequested"] != AUTO]
    for r in (r for r in results if r["microBatchesRequested"] == AUTO and fixed):
        best = max(fixed, key=lambda f: f["samplesPerSecond"])
        ratio = r["samplesPerSecond"] / best["samplesPerSecond"]
        rows.append(
            f"auto chose {r['microBatches']}; the best fixed count was"
            f" {best['microBatches']}: auto runs at {ratio:.2f}x its rate"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", type=Path, default=EXAMPLE, help="PipelineJob to start from")
    ap.add_argument(
        "--micro-batches",
        default="1,2,4,8,auto",
        help="comma-separated counts; auto: let the trainer choose",
    )
    ap.add_argument("--model")
    ap.add_argument("--stages", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--image-size", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    args = ap.parse_args(argv)

    base = yaml.safe_load(args.manifest.read_text())
    base["spec"].update({f: getattr(args, a) for a, f in OVERRIDES.items() if getattr(args, a)})
    counts = [m if m == AUTO else int(m) for m in args.micro_batches.split(",")]
    manifests = []
    for m in counts:
        manifest = copy.deepcopy(base)
        manifest["spec"]["microBatches"] = m
        manifest["spec"]["logEvery"] = max(1, manifest["spec"].get("steps", 10) // 5)
        try:
            parse(manifest, f"{args.manifest} with microBatches={m}")
        except InvalidSpec as e:
            sys.exit(str(e))
        manifests.append(manifest)

    s = parse(manifests[0]).spec
    print(
        f"PipelineJob {s['model']}, {s['stages']} stages, batch {s['batchSize']},"
        f" {s['imageSize']}x{s['imageSize']}, {s['steps']} steps (first left out as warm-up);"
        f" {os.cpu_count()} CPUs; micro-batches {counts}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="pipejob-bench-") as tmp:
        for manifest in manifests:
            started = time.monotonic()
            print(f"m={manifest['spec']['microBatches']}: running", flush=True)
            results.append(run_one(manifest, Path(tmp), args.timeout))
            print(
                f"m={manifest['spec']['microBatches']}: {results[-1]['samplesPerSecond']:.1f}"
                f" samples/s ({time.monotonic() - started:.0f} s with start-up)",
                flush=True,
            )
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
