"""Profiles of chosen steps: one Chrome trace per process per step (Kineto, all threads),
the driver's RPC calls with their remote ops from the legacy autograd profiler, the step's
named phases timed, and key_averages tables. Why two profilers: docs/architecture.md,
"Profiles"; what users get: docs/user-guide.md, "Profiles"."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch.autograd.profiler_legacy import profile as rpc_aware_profile

from pipejob.core.common_spec import CommonSpec
from pipejob.trainer.runtime import world
from pipejob.trainer.runtime.world import Env

SORT_BY = "self_cpu_time_total"  # on GPUs too: what keeps the host busy shows first
RPC_LANE = 1_000_000  # thread ids of the RPC lanes: RPC_LANE + node id of the callee
PHASE = "pipejob: "  # how a part of a driver's step is named in a trace


def phase(name: str) -> torch.profiler.record_function:
    """A part of a driver's step, named in a profile (microseconds when none runs)."""
    return torch.profiler.record_function(PHASE + name)


@dataclass(frozen=True)
class ProfileSettings:
    steps: frozenset[int]  # 1-based
    path: Path
    row_limit: int


def settings(spec: CommonSpec) -> ProfileSettings | None:
    """What spec.profile asks for; None when it is absent."""
    profile = spec.profile
    if profile is None:
        return None
    assert profile.path or spec.checkpoint, "the spec's rules require one of them"
    path = profile.path or str(Path(spec.checkpoint.path) / "profiles")
    return ProfileSettings(frozenset(profile.steps), Path(path), profile.row_limit)


def trace_path(directory: str | Path, name: str, step: int) -> Path:
    return Path(directory) / f"{name}-step{step}.json"


class _Window:
    """One process's profile of one step: Kineto on every thread, plus the RPC-aware
    profiles of the parts that make RPCs."""

    def __init__(self, step: int, directory: str, row_limit: int):
        self.step, self.directory, self.row_limit = step, directory, row_limit
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():  # the kernels too, with their streams
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        else:  # else Kineto logs a GPU-count "ERROR" on CPUs
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        self.kineto = torch.profiler.profile(
            activities=activities,
            experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True),
        )
        self.rpc_profiles: list[tuple[float, Any]] = []  # (wall clock at start, profile)
        self.kineto.start()

    @contextmanager
    def rpc_calls(self) -> Iterator[None]:
        started = time.time()
        with rpc_aware_profile() as profile:
            yield
        self.rpc_profiles.append((started, profile))

    def finish(self, name: str) -> tuple[str, int]:
        """Stop, write the trace, log the tables; (file, bytes)."""
        self.kineto.stop()
        path = trace_path(self.directory, name, self.step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.kineto.export_chrome_trace(str(tmp))
        if self.rpc_profiles:
            _add_rpc_lanes(tmp, self.rpc_profiles)
        os.replace(tmp, path)  # a reader never sees a partial trace
        averages = self.kineto.key_averages()
        table = averages.table(sort_by=SORT_BY, row_limit=self.row_limit)
        lines = [f"profile of step {self.step}, all threads ({path}):", table]
        parts = Phases(self.kineto.events())
        if parts:
            lines.insert(0, f"profile of step {self.step}, its parts: {parts}")
        if torch.cuda.is_available():
            on_gpu = averages.table(sort_by="self_device_time_total", row_limit=self.row_limit)
            lines += [f"profile of step {self.step}, by time on the GPU:", on_gpu]
        for i, (_, profile) in enumerate(self.rpc_profiles, 1):
            table = profile.key_averages().table(
                sort_by=SORT_BY, row_limit=self.row_limit, max_name_column_width=100
            )
            lines += [
                f"RPC calls ({i} of {len(self.rpc_profiles)}) and the ops they ran"
                " remotely (Node ID: rank):",
                table,
            ]
        print("\n".join(lines), flush=True)
        return str(path), path.stat().st_size


class Phases(dict[str, float]):
    """Seconds in each `phase` of a profile, summed over its calls, in the order they first
    began; `span`: from the first one's start to the last one's end."""

    def __init__(self, events: Any):
        super().__init__()
        marked = sorted(
            (e for e in events if e.name.startswith(PHASE)), key=lambda e: e.time_range.start
        )
        for e in marked:
            name = e.name.removeprefix(PHASE)
            self[name] = self.get(name, 0.0) + e.time_range.elapsed_us() / 1e6
        ends = [(e.time_range.start, e.time_range.end) for e in marked]
        self.span = (max(end for _, end in ends) - ends[0][0]) / 1e6 if ends else 0.0

    def __str__(self) -> str:
        """Each part's milliseconds and what is left of the span (between the parts: the
        driver's own work); the parts of replicas run at once, and may add up to more."""
        said = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in self.items())
        rest = self.span - sum(self.values())
        left = f", between them {rest * 1e3:.1f} ms" if rest > 0 else ""
        return f"{said}{left} (of {self.span * 1e3:.1f} ms)"


def _add_rpc_lanes(path: Path, profiles: list[tuple[float, Any]]) -> None:
    """Add the RPC events (`rpc_...#...`, and the remote ops under them) of RPC-aware
    profiles to a Kineto trace, one lane per callee, placed by the wall clock."""
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    base = trace.get("baseTimeNanoseconds", 0) / 1000  # Kineto's ts + base: wall clock in us
    pid, lanes = os.getpid(), set()
    for started, profile in profiles:
        for e in profile.function_events:
            if "#" not in e.name:
                continue  # a local op: Kineto has it already
            lanes.add(e.node_id)
            events.append(
                {
                    "ph": "X",
                    "cat": "rpc",
                    "name": e.name,
                    "pid": pid,
                    "tid": RPC_LANE + e.node_id,
                    "ts": started * 1e6 + e.time_range.start - base,
                    "dur": e.time_range.elapsed_us(),
                    "args": {"node id (rank)": e.node_id},
                }
            )
    for node in lanes:
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": pid,
                "tid": RPC_LANE + node,
                "args": {"name": f"RPC events, ops on rank {node}"},
            }
        )
    path.write_text(json.dumps(trace))


# ---------------------------------------------------------------------------- servers


_serving: _Window | None = None


def start(step: int, directory: str, row_limit: int) -> None:
    """Runs on a serving process (over RPC): profile every thread until `stop`."""
    global _serving
    if _serving is not None:
        raise RuntimeError(f"a profile of step {_serving.step} is still running")
    _serving = _Window(step, directory, row_limit)


def stop() -> tuple[str, int]:
    """Runs on a serving process (over RPC): end the profile, write and log it."""
    global _serving
    if _serving is None:
        raise RuntimeError("no profile is running")
    window, _serving = _serving, None
    return window.finish(rpc.get_worker_info().name)


# ---------------------------------------------------------------------------- drivers


RpcCalls = Callable[[], AbstractContextManager[None]]


@contextmanager
def window(
    env: Env,
    settings: ProfileSettings | None,
    step: int,
    servers: list[str] = (),
    sync: Callable[[], None] = lambda: None,
) -> Iterator[RpcCalls]:
    """Profile step `step` (1-based) here and on `servers` if the spec chose it. Yields
    `rpc_calls`: wrap the parts of the step that make RPCs in `with rpc_calls():`.

    `sync` runs after the servers' profiles started and before they stop, e.g. a barrier
    among hybrid trainers, so the servers' windows cover every driver's step."""
    if settings is None or step not in settings.steps:
        yield nullcontext
        return
    args = (step, str(settings.path), settings.row_limit)
    for name in servers:
        rpc.rpc_sync(name, start, args=args)
    sync()
    own = _Window(*args)
    yield own.rpc_calls
    written = [own.finish(env.rpc_name)]
    sync()
    written += [rpc.rpc_sync(name, stop) for name in servers]
    for file, size in written:
        world.log(env, f"profile: wrote {file} ({size / 1e6:.1f} MB)")
