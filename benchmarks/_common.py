"""Pieces every benchmark here shares: the machine's state, per-process counters read from
/proc, spread statistics, worker processes whose output carries measurement marks, and the
ResNet-50 split of the RPC pipeline tutorial (seed 000).

Benchmarks measure and print; none asserts anything about time."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# A line a worker prints to mark a moment of its measurement: "@@mark <name>".
MARK = "@@mark "
# A line a worker prints with its results: "@@result <json>".
RESULT = "@@result "


def load_average() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def machine() -> str:
    return f"{os.cpu_count()} CPUs, {load_average()}"


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(min, median, max)."""
    return min(values), statistics.median(values), max(values)


def fmt_spread(values: Sequence[float], digits: int = 1) -> str:
    lo, mid, hi = spread(values)
    return f"{mid:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


# ---------------------------------------------------------------------------- /proc counters


@dataclass
class Counters:
    """CPU seconds and page faults of one process, with CPU seconds per thread name."""

    cpu: float = 0.0
    minflt: int = 0
    majflt: int = 0
    threads: dict[str, float] = field(default_factory=dict)

    def __sub__(self, other: Counters) -> Counters:
        names = set(self.threads) | set(other.threads)
        return Counters(
            self.cpu - other.cpu,
            self.minflt - other.minflt,
            self.majflt - other.majflt,
            {n: self.threads.get(n, 0.0) - other.threads.get(n, 0.0) for n in names},
        )


def _stat_fields(path: str) -> tuple[str, list[str]]:
    text = Path(path).read_text()
    # comm is in parentheses and may hold spaces: split around the last ')'.
    comm = text[text.index("(") + 1 : text.rindex(")")]
    return comm, text[text.rindex(")") + 2 :].split()


def counters(pid: int) -> Counters:
    """The process's counters now; threads that exited are counted in the process totals
    (utime/stime include them) but not by name. An exited process counts zero."""
    try:
        _, f = _stat_fields(f"/proc/{pid}/stat")
    except (FileNotFoundError, ProcessLookupError):
        return Counters()
    # After ')' fields start at index 3 (state): minflt 10, majflt 12, utime 14, stime 15.
    result = Counters(
        cpu=(int(f[11]) + int(f[12])) / CLOCK_TICKS, minflt=int(f[7]), majflt=int(f[9])
    )
    by_name: dict[str, float] = defaultdict(float)
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        tids = []
    for tid in tids:
        try:
            comm, tf = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        except (FileNotFoundError, ProcessLookupError):
            continue
        by_name[re.sub(r"\d+$", "#", comm)] += (int(tf[11]) + int(tf[12])) / CLOCK_TICKS
    result.threads = dict(by_name)
    return result


def threads_summary(delta: Counters, per: float, top: int = 4) -> str:
    """The busiest thread names' CPU seconds per `per` unit (e.g. per batch)."""
    busiest = sorted(delta.threads.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{name} {seconds / per:.2f}" for name, seconds in busiest if seconds > 0)


# ---------------------------------------------------------------------------- worker processes


@dataclass
class Snapshot:
    at: float
    counters: dict[str, Counters]  # process name -> counters


class Workers:
    """Child processes whose output is relayed, whose `@@mark` lines snapshot every child's
    counters at that moment, and whose `@@result` lines are collected.

    Processes are started in their own process group and killed (group and all) on close, so
    nothing outlives a benchmark, even one that failed."""

    def __init__(self, echo: Callable[[str, str], None] | None = None):
        self.echo = echo
        self.procs: dict[str, subprocess.Popen] = {}
        self.pids: dict[str, int] = {}  # name -> pid whose counters are sampled
        self.marks: dict[str, Snapshot] = {}
        self.results: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._pumps: list[threading.Thread] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        popen = subprocess.Popen(
            argv,
            env=env,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0,
        )
        self.procs[name] = popen
        self.pids[name] = popen.pid
        pump = threading.Thread(target=self._pump, args=(name, popen), daemon=True)
        pump.start()
        self._pumps.append(pump)

    def watch_pid(self, name: str, pid: int) -> None:
        """Sample another process's counters at marks, too (e.g. a runner's children)."""
        with self._lock:
            self.pids[name] = pid

    def snapshot(self) -> Snapshot:
        with self._lock:
            pids = dict(self.pids)
        return Snapshot(time.perf_counter(), {n: counters(p) for n, p in pids.items()})

    def _pump(self, name: str, popen: subprocess.Popen) -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            line = line.rstrip("\n")
            self.on_line(name, line)

    def on_line(self, name: str, line: str) -> None:
        """Handle one output line; subclasses may look at lines first."""
        with self._lock:
            self.lines.append(f"{name}: {line}")
        if MARK in line:
            mark = line.split(MARK, 1)[1].strip()
            self.marks[mark] = self.snapshot()
        elif RESULT in line:
            self.results.append(json.loads(line.split(RESULT, 1)[1]))
        elif self.echo is not None:
            self.echo(name, line)

    def between(self, first: str, last: str) -> tuple[float, dict[str, Counters]]:
        """Wall seconds and counter deltas between two marks."""
        a, b = self.marks[first], self.marks[last]
        return b.at - a.at, {n: b.counters[n] - a.counters.get(n, Counters()) for n in b.counters}

    def wait(self, timeout: float, main: str | None = None) -> dict[str, int]:
        """Wait for every process (or only `main`, then stop the rest); exit codes by name."""
        deadline = time.monotonic() + timeout
        waiting = [main] if main else list(self.procs)
        for name in waiting:
            left = max(0.1, deadline - time.monotonic())
            try:
                self.procs[name].wait(left)
            except subprocess.TimeoutExpired:
                self.close()
                raise TimeoutError(f"{name} did not finish within {timeout:g}s") from None
        if main:
            self.close(grace=30)
        for pump in self._pumps:
            pump.join(5)
        return {n: p.returncode for n, p in self.procs.items()}

    def close(self, grace: float = 0.0) -> None:
        for popen in self.procs.values():
            if popen.poll() is None and grace:
                try:
                    popen.wait(grace)
                except subprocess.TimeoutExpired:
                    pass
            if popen.poll() is None:
                try:
                    os.killpg(popen.pid, 9)
                except ProcessLookupError:
                    pass
                popen.wait()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tail(self, n: int = 30) -> str:
        with self._lock:
            return "\n".join(self.lines[-n:])


def mark(name: str) -> None:
    """Print a mark for the orchestrating benchmark (flushed at once: its time matters)."""
    print(f"{MARK}{name}", flush=True)


def result(payload: dict[str, Any]) -> None:
    print(f"{RESULT}{json.dumps(payload)}", flush=True)


def timed_batches(
    step: Callable[[Any], None], name: str, batch: int, image: int, warmup: int, batches: int
) -> list[float]:
    """Seconds of `step` on each of `batches` random image batches after `warmup` ones, with
    marks `<name>-start` and `<name>-end` around the measured ones."""
    import torch

    seconds = []
    for i in range(warmup + batches):
        if i == warmup:
            mark(f"{name}-start")
        inputs = torch.randn(batch, 3, image, image)
        start = time.perf_counter()
        step(inputs)
        seconds.append(time.perf_counter() - start)
    mark(f"{name}-end")
    return seconds[warmup:]


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, str(HERE / script), *args]


def thread_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a worker that should use `threads` intra-op threads in every one of
    its threads (OpenMP reads OMP_NUM_THREADS once, when torch loads it). A team of several
    threads sleeps while it waits: spinning on a shared host costs several times the time."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    if threads > 1:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    env.update(extra or {})
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- the model


def tutorial_split(num_classes: int = 1000):
    """torchvision's ResNet-50 cut where the tutorial cuts it: conv1 .. layer2 | layer3 .. fc."""
    from torch import nn
    from torchvision.models import resnet50

    model = resnet50(num_classes=num_classes)
    first = nn.Sequential(
        model.conv1, model.bn1, model.relu, model.maxpool, model.layer1, model.layer2
    )
    second = nn.Sequential(model.layer3, model.layer4, model.avgpool, nn.Flatten(1), model.fc)
    return first, second


def one_hot(batch: int, num_classes: int, seed: int = 0):
    """The tutorial's labels: one-hot rows for MSELoss."""
    import torch

    g = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, num_classes, (batch, 1), generator=g)
    return torch.zeros(batch, num_classes).scatter_(1, indices, 1)


STARTED_LINE = re.compile(r"started (\S+) \(rank \d+, pid (\d+)\)")


class RunnerWorkers(Workers):
    """`pipejob run` as the one worker: follows the pids it reports, stops its world."""

    def on_line(self, name: str, line: str) -> None:
        started = STARTED_LINE.search(line)
        if started:
            self.watch_pid(started.group(1), int(started.group(2)))
        super().on_line(name, line)

    def close(self, grace: float = 0.0) -> None:
        for popen in self.procs.values():  # the runner stops its world on SIGTERM
            if popen.poll() is None:
                popen.terminate()
                try:
                    popen.wait(30)
                except subprocess.TimeoutExpired:
                    pass
        for name, pid in self.pids.items():  # anything of it still alive goes by its pid
            if name not in self.procs:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        super().close(grace)


STEP_LINE = re.compile(r"^master\s*\| .*\bstep (\d+)/(\d+)")


class PipejobWorkers(RunnerWorkers):
    """`pipejob run` as one child: marks come from the master's step lines, and the runner's
    trainer processes (named in its "started" lines) are sampled too."""

    def __init__(self, steps: int, warmup: int, m: int | str, echo_line):
        super().__init__(echo_line)
        self.steps, self.warmup, self.m = steps, warmup, m

    def on_line(self, name: str, line: str) -> None:
        step = STEP_LINE.match(line)
        if step and int(step.group(1)) == self.warmup:
            self.marks[f"m{self.m}-start"] = self.snapshot()
        elif step and int(step.group(1)) == self.steps:
            self.marks[f"m{self.m}-end"] = self.snapshot()
        super().on_line(name, line)


def run_job(
    job: dict[str, Any],
    stem: Path,
    key: int | str,
    steps: int,
    warmup: int,
    timeout: float,
    env: dict[str, str],
    echo_line=None,
) -> tuple[dict[str, Any], float, dict[str, Counters]]:
    """`pipejob run` of `job` (written to <stem>.yaml; `steps` in all, the first `warmup` left
    out) in `env`: its summary (also in <stem>.json), and the wall seconds and per-process
    counters between the master's step lines around the measured steps. `key` names the run
    in its marks. Its whole output goes to <stem>.log."""
    path, summary_file = stem.with_suffix(".yaml"), stem.with_suffix(".json")
    path.write_text(yaml.safe_dump(job))
    summary_file.unlink(missing_ok=True)
    with PipejobWorkers(steps, warmup, key, echo_line) as w:
        w.start(
            "runner",
            [sys.executable, "-m", "pipejob.cli", "run", str(path)],
            env | {"PIPEJOB_SUMMARY_FILE": str(summary_file)},
        )
        try:
            codes = w.wait(timeout)
        except TimeoutError as e:  # what the run said last tells where it was
            raise TimeoutError(f"{stem.name}: {e}:\n{w.tail()}") from None
        finally:
            stem.with_suffix(".log").write_text("\n".join(w.lines) + "\n")
        if codes["runner"] != 0 or not summary_file.exists():
            raise RuntimeError(f"{stem.name} failed ({codes}):\n{w.tail()}")
        wall, deltas = w.between(f"m{key}-start", f"m{key}-end")
    return json.loads(summary_file.read_text()), wall, deltas
