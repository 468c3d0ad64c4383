"""Same seed, same bits (issue 57): every example manifest run twice, its two runs compared.

Each example under examples/ that runs on this machine with `pipejob run` (and each case under
benchmarks/repeat/: issue 57's digits, real images and a user's CNN) is run twice, each
run in a fresh copy of its folder (the files git tracks there, plus what the example says to
write first), and the two are compared: every file a run wrote, byte for byte, and the losses
it logged (the summary's every step, and the master's step lines). The GPU examples, and
those that need what a shared machine does not have, are left out, each saying why.

Overridden, and said in the table's notes: `--steps` (fewer steps; a warmup or a checkpoint
interval longer than the run shortened to fit), a path outside the run's folder (the
checkpoint's /checkpoints) made one inside it, `--engines`, `--replicas` and `--set`. Two
things a run writes from its clock, not its arithmetic, are left out of the bytes, and said
here: the TensorBoard event files are compared by their scalars (every tag but the samples/s
and the bubble), and a checkpoint's manifest.json without its "time" and the timings the cut
was chosen by ("costs", "microBatchCandidates"; its "stages" are compared).

    python benchmarks/repeat_runs.py                          # every example, as written
    python benchmarks/repeat_runs.py --steps 10,hybrid=300    # 10 steps, hybrid.yaml its 300
    python benchmarks/repeat_runs.py --engines rpc,pipelining # each PipelineJob on both
    python benchmarks/repeat_runs.py --only transformer-lm --replicas 2
    python benchmarks/repeat_runs.py --set deterministic=true  # every spec, with this field
    python benchmarks/repeat_runs.py --only digits --engines rpc,pipelining --replicas 2

Prints a table (example, engine, shape, steps, identical, the first difference) and exits 1
if any pair differs or a run fails."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from _common import REPO, RunnerWorkers, machine

EXAMPLES = REPO / "examples"
# Cases that are not examples, run as they are (issue 57's digits case): named like them.
CASES = REPO / "benchmarks" / "repeat"
KINDS = ("PipelineJob", "HybridJob")
# Examples this machine cannot run, and why (a GPU job says so by its spec: gpu_reason).
SKIP = {
    "dlrm/days.yaml": "its click logs are gzip day files under /data/criteo that make_days.py"
    " writes (about 2.3 GB for 10M lines), and its 26 tables are 33.8M rows (2.2 GB of weights"
    " over 3 servers): a job for a cluster's volume, not a shared machine",
}
# What an example says to run first (its header), in its folder's copy, once for both runs.
PREPARE = {"lora-causal-lm/pipelinejob.yaml": ["base.py"]}
# The libraries an example's own code imports.
NEEDS = {
    "hf-causal-lm/pipelinejob.yaml": ("transformers",),
    "lora-causal-lm/pipelinejob.yaml": ("transformers", "peft"),
}
# Scalars written from the clock (runtime/events.py's TAGS): not compared.
TIMED_TAGS = {"train/samples_per_second", "train/bubble"}
STEP_LINE = re.compile(r"^master\s*\| .*?\bstep (\d+)/\d+\s+loss (\S+)(?:.*grad norm (\S+))?")
CHOSE_LINE = re.compile(r"engine auto chose (\w+)")


@dataclass
class Case:
    """One example at one engine: the manifest to run twice, what was changed in it."""

    example: str  # its path under examples/
    manifest: dict[str, Any]
    overrides: list[str] = field(default_factory=list)
    skip: str | None = None


@dataclass
class Run:
    code: int | str  # the runner's exit code, or why it did not end
    lines: list[str]
    summary: dict[str, Any] | None
    files: dict[str, bytes]  # what the run wrote, by path under its folder
    seconds: float


def names(example: str) -> tuple[str, ...]:
    """What an example answers to: its path, without .yaml, and its folder."""
    return example, example.removesuffix(".yaml"), example.split("/")[0]


def where(example: str) -> Path:
    """The manifest of `example`: under examples/, else under benchmarks/repeat/."""
    return EXAMPLES / example if (EXAMPLES / example).exists() else CASES / example


def discover(only: list[str]) -> list[str]:
    """Every job manifest under examples/ and benchmarks/repeat/ (paths under them), or
    those `only` names."""
    found = [
        str(path.relative_to(root))
        for root in (EXAMPLES, CASES)
        for path in sorted([*root.glob("*.yaml"), *root.glob("*/*.yaml")])
        if yaml.safe_load(path.read_text()).get("kind") in KINDS
    ]
    missing = [o for o in only if not any(o in names(e) for e in found)]
    if missing:
        raise SystemExit(f"--only: no example {', '.join(missing)}; there are {', '.join(found)}")
    return [e for e in found if not only or set(only) & set(names(e))]


def gpu_reason(spec: dict[str, Any]) -> str | None:
    for key in ("gpusPerStage", "gpusPerTrainer"):
        if spec.get(key):
            return f"a GPU job ({key}: {spec[key]}); the CPU examples are the ones run here"
    return None


def steps_for(example: str, steps: dict[str, int]) -> int | None:
    """--steps' count for `example`: its own entry, else the default ("*"), else None."""
    return next((steps[k] for k in names(example) if k in steps), steps.get("*"))


def shortened(spec: dict[str, Any], steps: int | None) -> list[str]:
    """Fewer steps where asked (in place), and what had to follow them; what was changed."""
    if steps is None or steps >= spec["steps"]:
        return []
    said = [f"steps {spec['steps']}->{steps}"]
    spec["steps"] = steps
    warmup = spec.get("optimizer", {}).get("schedule", {})
    if warmup.get("warmupSteps", 0) > steps:  # refused: warmup is part of the run
        said.append(f"warmupSteps {warmup['warmupSteps']}->{steps // 2}")
        warmup["warmupSteps"] = steps // 2
    every = spec.get("checkpoint", {})
    if every.get("everySteps", 0) > steps:  # else no checkpoint is written to compare
        said.append(f"checkpoint.everySteps {every['everySteps']}->{steps}")
        every["everySteps"] = steps
    return said


def inside(spec: dict[str, Any]) -> list[str]:
    """Paths a run writes outside its folder made relative (in place); what was changed."""
    said = []
    for section, key in (("checkpoint", "path"), ("output", "path"), ("logging", "tensorboard")):
        value = spec.get(section, {}).get(key)
        if isinstance(value, str) and value.startswith("/"):
            spec[section][key] = value.lstrip("/")
            said.append(f"{section}.{key} {value}->{spec[section][key]}")
            if spec[section].pop("volume", None):  # a pod's mount: a relative path has none
                said.append(f"{section}.volume dropped")
    return said


def cases(example: str, args: argparse.Namespace) -> list[Case]:
    """`example` at each engine asked for, overridden to run here, or why it cannot."""
    manifest = yaml.safe_load(where(example).read_text())
    spec = manifest["spec"]
    missing = [m for m in NEEDS.get(example, ()) if importlib.util.find_spec(m) is None]
    skip = SKIP.get(example) or gpu_reason(spec)
    if missing:
        skip = skip or f"needs {', '.join(missing)} (pip install {' '.join(missing)})"
    if skip:
        return [Case(example, manifest, skip=skip)]
    engines = [None]
    if manifest["kind"] == "PipelineJob" and args.engines:
        engines = args.engines
    return [engine_case(example, manifest, engine, args) for engine in engines]


def engine_case(
    example: str, manifest: dict[str, Any], engine: str | None, args: argparse.Namespace
) -> Case:
    from pipejob.core import spec as specs

    manifest = copy.deepcopy(manifest)
    spec = manifest["spec"]
    said = shortened(spec, steps_for(example, args.steps)) + inside(spec)
    if engine is not None and spec.get("engine") != engine:
        said.append(f"engine {spec.get('engine', 'auto')}->{engine}")
        spec["engine"] = engine
        if engine == "rpc" and spec.get("schedule", "gpipe") != "gpipe":
            said.append(f"schedule {spec.pop('schedule')} dropped (rpc runs gpipe)")
    for key, value in args.set:
        said.append(f"{key} {spec[key]}->{value}" if key in spec else f"{key}: {value}")
        spec[key] = value
    if args.replicas and manifest["kind"] == "PipelineJob":
        said.append(f"replicas {spec.get('replicas', 1)}->{args.replicas}")
        spec["replicas"] = args.replicas
    try:
        specs.parse(manifest)
    except specs.InvalidSpec as e:
        return Case(example, manifest, said, skip=f"refused once overridden: {e}")
    return Case(example, manifest, said)


def source(example: str, into: Path) -> Path:
    """A copy of the example's folder as git has it (a top-level manifest: a folder with only
    itself), with what the example says to write first written in it."""
    folder = where(example).parent
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "--", "."], cwd=folder, capture_output=True, check=True
    ).stdout.decode()
    names = [n for n in tracked.split("\0") if n and ("/" in example or n == Path(example).name)]
    for name in names:
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(folder / name, into / name)
    for script in PREPARE.get(example, []):
        subprocess.run([sys.executable, script], cwd=into, check=True, capture_output=True)
    if example == "digits/pipelinejob.yaml":
        write_digits_case(into)
    return into


def write_digits_case(into: Path) -> None:
    """What the digits case reads, beside its manifest: scikit-learn's digits as an image
    folder (digits/train, digits/val) and the small CNN's package (tests/userpkg)."""
    sys.path.insert(0, str(REPO / "tests"))
    from userdata import write_digits

    write_digits(into / "digits")
    shutil.copytree(REPO / "tests" / "userpkg", into / "userpkg", ignore=IGNORED)


IGNORED = shutil.ignore_patterns("__pycache__")


def listing(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def run_once(case: Case, src: Path, kept: Path, timeout: float) -> Run:
    """One run of `case` in a copy of `src`, moved to `kept` after: what it wrote, and said.
    Both runs of a case run in one folder, as a user's two runs of a manifest would (a path
    the run records, such as a Hugging Face model's _name_or_path, is the same)."""
    folder = kept.with_name("run")
    shutil.copytree(src, folder, symlinks=True)
    manifest = folder / f"repeat-{Path(case.example).name}"
    manifest.write_text(yaml.safe_dump(case.manifest, sort_keys=False))
    before = set(listing(folder))
    summary_file = kept.with_name(kept.name + "-summary.json")
    env = os.environ | {"PIPEJOB_SUMMARY_FILE": str(summary_file), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    with RunnerWorkers() as w:
        w.start("runner", [sys.executable, "-m", "pipejob.cli", "run", str(manifest)], env)
        try:
            code: int | str = w.wait(timeout)["runner"]
        except TimeoutError:
            code = f"not done in {timeout:g} s"
        lines = [line.split(": ", 1)[1] for line in w.lines]
    kept.with_name(kept.name + ".log").write_text("\n".join(lines) + "\n")
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
    wrote = {k: v for k, v in listing(folder).items() if k not in before}
    folder.rename(kept)
    return Run(code, lines, summary, wrote, time.monotonic() - start)


def step_lines(lines: list[str]) -> dict[int, tuple[str, ...]]:
    """The master's step lines: (loss, grad norm) as printed, by step."""
    found = {}
    for line in lines:
        m = STEP_LINE.match(line)
        if m:
            found[int(m.group(1))] = tuple(g for g in m.groups()[1:] if g is not None)
    return found


def first_difference(a: Run, b: Run, folders: tuple[Path, Path]) -> str | None:
    """Where two runs of one manifest first differ: losses, step lines, then files."""
    assert a.summary is not None and b.summary is not None
    for key in ("losses", "gradNorms"):
        left, right = a.summary.get(key), b.summary.get(key)
        if left != right:
            pairs = enumerate(zip(left or [], right or [], strict=False))
            at = next((i for i, (x, y) in pairs if x != y), min(len(left or []), len(right or [])))
            return f"summary {key}[{at}]: {left[at : at + 1]} / {right[at : at + 1]}"
    lines_a, lines_b = step_lines(a.lines), step_lines(b.lines)
    for step in sorted(set(lines_a) | set(lines_b)):
        if lines_a.get(step) != lines_b.get(step):
            return f"step line {step}: {lines_a.get(step)} / {lines_b.get(step)}"
    events = sorted({str(Path(n).parent) for n in [*a.files, *b.files] if "tfevents" in n})
    for name in sorted(set(a.files) | set(b.files)):
        if "tfevents" not in name and (differs := file_difference(name, a, b)):
            return differs
    for directory in events:
        left, right = (scalars(f / directory) for f in folders)
        if left != right:
            tag = next(t for t in sorted(set(left) | set(right)) if left.get(t) != right.get(t))
            return f"{directory}: TensorBoard's {tag} differs"
    return None


def file_difference(name: str, a: Run, b: Run) -> str | None:
    if name not in a.files or name not in b.files:
        return f"{name}: written by run {'a' if name in a.files else 'b'} only"
    left, right = a.files[name], b.files[name]
    if "/step-" in name and name.endswith("/manifest.json"):  # a checkpoint's
        left, right = untimed(left), untimed(right)
    return None if left == right else f"{name}: bytes differ"


# A checkpoint manifest's clock readings: when it was written, and the cut's measured costs
# and auto's predicted step times, kept for a resume (counted ones with spec.deterministic).
CLOCK_FIELDS = ("time", "costs", "microBatchCandidates")


def untimed(text: bytes) -> bytes:
    """A checkpoint's manifest without its clock readings (the cut they chose stays)."""
    manifest = json.loads(text)
    for key in CLOCK_FIELDS:
        manifest.pop(key, None)
    return json.dumps(manifest, sort_keys=True).encode()


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in `directory` but the clock's, by tag, as TensorBoard
    reads them back."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0}).Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
        if tag not in TIMED_TAGS
    }


@dataclass
class Row:
    case: Case
    engine: str = "-"
    shape: str = "-"
    steps: str = "-"
    identical: str = "skipped"
    difference: str = ""
    notes: list[str] = field(default_factory=list)


def describe(case: Case, a: Run, b: Run, row: Row) -> None:
    """The row's engine, shape and steps from the runs' summaries and logs, and where the two
    runs chose differently (the cut, auto's micro-batches or engine)."""
    spec = case.manifest["spec"]
    row.steps = str(spec["steps"])
    if case.manifest["kind"] == "HybridJob":
        row.engine = "hybrid"
        row.shape = f"{spec['trainers']} trainers, {spec.get('parameterServers', 1)} servers"
        return
    chose = [
        next((m.group(1) for x in r.lines if (m := CHOSE_LINE.search(x))), None) for r in (a, b)
    ]
    named = spec.get("engine", "auto")
    row.engine = named if named != "auto" else f"auto: {'/'.join(sorted({str(c) for c in chose}))}"
    got = [r.summary or {} for r in (a, b)]
    m = "/".join(sorted({str(g.get("microBatches")) for g in got}))
    row.shape = f"{spec['stages']} stages x {spec.get('replicas', 1)}, m={m}"
    cuts = [" | ".join(p["pieces"] for p in g.get("partition", [])) for g in got]
    row.notes.append(
        f"cut ({got[0].get('cutBy')}): "
        + (cuts[0] if cuts[0] == cuts[1] else f"run a {cuts[0]}; run b {cuts[1]}")
    )


def repeat(case: Case, work: Path, timeout: float) -> Row:
    """`case` run twice in `work`: its row of the table."""
    row = Row(case, notes=list(case.overrides))
    if case.skip:
        row.engine = case.manifest["spec"].get("engine", "-")
        row.difference = case.skip
        return row
    src = source(case.example, Path(tempfile.mkdtemp(dir=work, prefix="src-")))
    folders = (work / "a", work / "b")
    a, b = (run_once(case, src, f, timeout) for f in folders)
    print(f"    ran in {a.seconds:.0f} s and {b.seconds:.0f} s", flush=True)
    describe(case, a, b, row)
    for name, run in (("a", a), ("b", b)):
        if run.code != 0 or run.summary is None:
            row.identical = "failed"
            row.difference = f"run {name} ({run.code}): {' / '.join(run.lines[-2:])}"[:300]
            return row
    differs = first_difference(a, b, folders)
    row.identical = "no" if differs else "yes"
    row.difference = (
        differs or f"{len(a.files)} files, {len((a.summary or {}).get('losses', []))} losses"
    )
    return row


def table(rows: list[Row]) -> str:
    head = ("example", "engine", "shape", "steps", "identical", "first difference")
    cells = [head] + [
        (r.case.example, r.engine, r.shape, r.steps, r.identical, r.difference) for r in rows
    ]
    width = [max(len(c[i]) for c in cells) for i in range(5)]
    out = ["  ".join(c[i].ljust(width[i]) for i in range(5)) + "  " + c[5] for c in cells]
    for r in rows:
        out += [f"  {r.case.example} ({r.engine}): {note}" for note in r.notes]
    return "\n".join(out)


def step_counts(text: str) -> dict[str, int]:
    """--steps: "10" or "10,hybrid=300,dlrm=75" ("*" is the default)."""
    counts = {}
    for item in filter(None, text.split(",")):
        name, _, n = item.rpartition("=")
        counts[name or "*"] = int(n)
    return counts


def setting(text: str) -> tuple[str, Any]:
    """--set: "FIELD=VALUE", the value as YAML reads it (deterministic=true)."""
    key, _, value = text.partition("=")
    return key, yaml.safe_load(value)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="examples by path or stem, comma-separated")
    ap.add_argument("--steps", type=step_counts, default={}, help="N, or N,EXAMPLE=N,...")
    ap.add_argument("--engines", default="", help="e.g. rpc,pipelining: each PipelineJob on each")
    ap.add_argument("--replicas", type=int, default=0, help="each PipelineJob at this many")
    ap.add_argument(
        "--set", type=setting, action="append", default=[], help="FIELD=VALUE in every spec"
    )
    ap.add_argument("--timeout", type=float, default=1200, help="seconds a run may take")
    ap.add_argument("--keep", type=Path, help="leave the runs' folders and logs here")
    args = ap.parse_args()
    args.engines = [e for e in args.engines.split(",") if e]
    print(f"repeat_runs: every example twice; {machine()}", flush=True)
    rows = []
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="repeat-runs-", dir=args.keep))
    try:
        for example in discover([o for o in args.only.split(",") if o]):
            for k, case in enumerate(cases(example, args)):
                print(f"  {example} {' '.join(case.overrides)}", flush=True)
                work = root / f"{example.replace('/', '-')}-{k}"
                work.mkdir()
                rows.append(repeat(case, work, args.timeout))
                print(f"    identical: {rows[-1].identical}; {rows[-1].difference}", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"runs kept in {root}")
    print("\n" + table(rows))
    return 1 if any(r.identical in ("no", "failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
