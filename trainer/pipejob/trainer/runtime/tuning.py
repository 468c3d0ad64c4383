"""Per-process performance settings (intra-op threads, the malloc, TensorPipe's transport),
decided from the env contract and the host and applied at trainer start, before torch loads.
A variable the user set (OMP_NUM_THREADS, OMP_WAIT_POLICY, MALLOC_ARENA_MAX,
MKL_DISABLE_FAST_MM, an LD_PRELOAD naming a malloc, the malloc's own settings) always wins;
PIPEJOB_TUNING picks the levers (pipejob.core.tuning_levers). What each lever does and the
measurements behind it: docs/user-guide.md, "Performance settings"."""

from __future__ import annotations

import ctypes
import json
import math
import os
import platform
import sys
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from pipejob.core import contract as c
from pipejob.core import tuning_levers
from pipejob.core.kind import RawSpec
from pipejob.core.kinds import KINDS
from pipejob.trainer.runtime.world import loopback

TUNING = c.TUNING
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
WAIT_VARIABLE = "OMP_WAIT_POLICY"
OVERSUBSCRIBE = 2  # compute threads per core of a share under 2 CPUs (measured for 2 stages)
ARENA_VARIABLE = "MALLOC_ARENA_MAX"  # the user's (glibc's own variable) wins
MKL_CACHE_VARIABLE = "MKL_DISABLE_FAST_MM"  # MKL's own; read at its first allocation
# glibc's mallopt parameters, and the values of the allocator lever.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
TRIM_THRESHOLD = 1 << 30  # free memory kept at the heap's top before it is given back
MMAP_THRESHOLD = 32 << 20  # glibc's largest; blocks above it are mapped (and unmapped) alone
CPU_TRANSPORTS = ["uv"]
CPU_CHANNELS = ["basic"]


@dataclass(frozen=True)
class ProcessTuning:
    """One process's performance settings: what `decide` chose, or `apply` applied."""

    threads: int | None = None  # intra-op threads; None: torch's default
    passive_wait: bool = False  # OpenMP threads sleep while they wait (cores are shared)
    arena_max: int | None = None  # glibc malloc arenas; None: glibc's default
    mkl_from_malloc: bool = False  # MKL's buffers from the malloc, not a cache of its own
    transports: list[str] | None = None  # TensorPipe transports; None: torch's default
    channels: list[str] | None = None  # TensorPipe channels; None: torch's default
    malloc: str = ""  # the malloc it runs with (running_malloc): name and library
    missing: str = ""  # why it is not the one PIPEJOB_TUNING asks for, where that is so

    def describe(self) -> str:
        memory = f"malloc {self.malloc}" if self.malloc else None
        if memory and self.arena_max:
            memory += f" with {self.arena_max} arena(s) keeping freed memory"
        if memory and self.missing:
            memory += f": {self.missing}"
        parts = [
            f"{self.threads} intra-op thread(s)" if self.threads else None,
            "passive OpenMP waits" if self.passive_wait else None,
            memory,
            "MKL buffers from the malloc" if self.mkl_from_malloc else None,
            f"TensorPipe {'+'.join(self.transports)}/{'+'.join(self.channels or ['default'])}"
            if self.transports
            else None,
        ]
        return ", ".join(p for p in parts if p) or "torch's defaults"


# ---------------------------------------------------------------------------- pure decisions


def cgroup_cpus(cpu_max: str | None) -> float | None:
    """CPUs granted by a cgroup v2 `cpu.max` ("<quota> <period>" or "max <period>")."""
    if not cpu_max:
        return None
    quota, _, period = cpu_max.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def same_host(a: str, b: str) -> bool:
    """Whether two addresses of the world name the same machine: equal, or both loopback."""
    return a == b or (loopback(a) and loopback(b))


def computes(kind: str, role: str) -> bool:
    """Whether the role does the model's arithmetic; the others mostly wait on RPCs."""
    return KINDS[kind].role(role).computes


def compute_roles(kind: str, role: str, spec: RawSpec) -> int:
    """The compute roles a process of `role` runs: its own if it computes, and those the spec
    puts inside it (a HybridJob's trainer with spec.serversInTrainers runs a server too)."""
    inside = [r for r in KINDS[kind].roles if r.computes and r.hosted(spec) == role]
    return int(computes(kind, role)) + len(inside)


def colocated_compute(
    kind: str,
    roles: Sequence[str],
    addresses: Sequence[str],
    rank: int,
    spec: RawSpec | None = None,
) -> int:
    """Compute roles of the world (`roles` in rank order; `spec` the job's, for the roles
    run inside others' processes) on this process's host (with this one's, if it computes).
    Without addresses every process is taken to have a host of its own."""
    spec = spec or {}
    if len(addresses) != len(roles):
        return compute_roles(kind, roles[rank], spec)
    mine = addresses[rank]
    return sum(
        compute_roles(kind, role, spec)
        for role, address in zip(roles, addresses, strict=True)
        if same_host(address, mine)
    )


def decide(
    kind: str,
    role: str,
    gpus: int,
    cpus: float,
    colocated: int,
    enabled: Collection[str],
    malloc: str = "glibc",
    spec: RawSpec | None = None,
) -> ProcessTuning:
    """The settings of one process: its job kind and role, its GPUs, the CPUs it may use, how
    many compute processes share them, the malloc it runs with (running_malloc) and its
    job's spec (a role may want one thread where crowded: Role.one_thread_when_crowded)."""
    threads = arena = None
    passive = "threads" in enabled and colocated > 1
    if "threads" in enabled:
        if computes(kind, role):
            share = cpus / max(1, colocated)
            crowded = share <= 1 and KINDS[kind].role(role).one_thread_when_crowded(spec or {})
            if share < 2 and not crowded:
                share *= OVERSUBSCRIBE
            threads = max(1, math.floor(min(cpus, share)))
        elif colocated > 0:
            threads = 1  # a light role leaves the shared cores to the compute roles
        else:
            threads = max(1, math.floor(cpus))
    if "allocator" in enabled and malloc == "glibc":
        arena = 1
    polling_pays = KINDS[kind].role(role).latency_bound and 1 < colocated <= cpus / 2
    return ProcessTuning(
        threads, passive, arena, "allocator" in enabled, *transport(gpus, enabled, polling_pays)
    )


def transport(
    gpus: int, enabled: Collection[str], polling_pays: bool
) -> tuple[list[str] | None, list[str] | None]:
    """TensorPipe transports and channels: uv and basic for CPU-only processes unless the
    shared-memory transport's polling pays (see the module's docstring); torch's defaults
    (None) otherwise, or when the lever is off."""
    if "transport" in enabled and gpus == 0 and not polling_pays:
        return list(CPU_TRANSPORTS), list(CPU_CHANNELS)
    return None, None


# ---------------------------------------------------------------------------- the host


def available_cpus() -> float:
    """CPUs this process may use: its affinity, bounded by its cgroup's quota."""
    cpus: float = len(os.sched_getaffinity(0))
    try:
        quota = cgroup_cpus(Path("/sys/fs/cgroup/cpu.max").read_text())
    except OSError:
        quota = None
    return min(cpus, quota) if quota else cpus


def for_process(
    kind: str, role: str, rank: int, roles: Sequence[str], gpus: int, environ: Mapping[str, str]
) -> ProcessTuning:
    addresses = [a for a in environ.get(c.ADDRESSES, "").split(",") if a]
    spec = json.loads(environ.get(c.SPEC) or "{}")
    colocated = colocated_compute(kind, roles, addresses, rank, spec)
    enabled = tuning_levers.parse(environ.get(TUNING))
    malloc, library = running_malloc()
    cpus = available_cpus()
    settings = decide(kind, role, gpus, cpus, colocated, enabled, malloc, spec)
    words = f"{malloc} ({library})" if library else malloc
    return replace(
        settings, malloc=words, missing=missing(library, tuning_levers.wanted_malloc(environ))
    )


def running_malloc(maps: str | None = None) -> tuple[str, str]:
    """The malloc this process runs with, by the libraries loaded in it (/proc/self/maps):
    (jemalloc, tcmalloc or another preloaded one's name, its file), or (the C library's
    name, "") where none is."""
    if maps is None:
        maps = Path("/proc/self/maps").read_text()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
        file = os.path.basename(fields[5]) if len(fields) == 6 else ""
        if "malloc" in file:
            name = next((m for m in tuning_levers.MALLOCS if m in file), file.split(".so")[0][3:])
            return name, file
    return platform.libc_ver()[0] or "libc", ""


def missing(library: str, wanted: tuning_levers.Malloc | None) -> str:
    """Why this process runs with the C library's malloc (no preloaded `library`) where
    PIPEJOB_TUNING asks for another, or ""."""
    if library or wanted is None or not wanted.library:
        return ""
    return f"{wanted.name} is not installed here (Debian's {wanted.package})"


def preload_malloc() -> None:
    """Start this process over with the malloc PIPEJOB_TUNING asks for preloaded, where its
    launcher did not preload it (a pod; the local runner does): the dynamic linker reads
    LD_PRELOAD only when a program starts. Call it first: the process begins again."""
    extra = tuning_levers.preload_env(os.environ)
    if extra:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], os.environ | extra)


# ---------------------------------------------------------------------------- applying


def apply(settings: ProcessTuning, environ: dict[str, str] | None = None) -> ProcessTuning:
    """Apply the settings to this process; must run before torch is imported. Variables the
    user set win. Returns what was applied."""
    environ = os.environ if environ is None else environ
    threads = settings.threads
    if threads is not None:
        if any(environ.get(v) for v in THREAD_VARIABLES):
            threads = None  # the user's (or the runner's) choice stands
        else:
            for variable in THREAD_VARIABLES:
                environ[variable] = str(threads)
            if "torch" in sys.modules:  # too late for OpenMP's start-up: bound what we can
                sys.modules["torch"].set_num_threads(threads)
    passive = settings.passive_wait and not environ.get(WAIT_VARIABLE)
    if passive:
        environ[WAIT_VARIABLE] = "PASSIVE"
    arena = settings.arena_max
    if arena is not None:
        if environ.get(ARENA_VARIABLE) or not _keep_memory(arena):
            arena = None
    mkl = settings.mkl_from_malloc and not environ.get(MKL_CACHE_VARIABLE)
    if mkl:
        environ[MKL_CACHE_VARIABLE] = "1"
    return replace(
        settings, threads=threads, passive_wait=passive, arena_max=arena, mkl_from_malloc=mkl
    )


def _keep_memory(arenas: int) -> bool:
    global _mmap_threshold
    libc = _glibc()
    if libc is None:
        return False
    settings = (
        (M_ARENA_MAX, arenas),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    )
    kept = all([bool(libc.mallopt(parameter, value)) for parameter, value in settings])
    if kept:
        _mmap_threshold = MMAP_THRESHOLD
    return kept


def _glibc() -> ctypes.CDLL | None:
    return ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None


# This process's mmap threshold: glibc's first one until `_keep_memory` sets its own.
_mmap_threshold = 128 << 10
# While a part of the model is built or measured (pipeline/stage_build.py), every parameter of the
# model is allocated and freed once, briefly: above this size a block is mapped alone and
# given back when freed, where the heap that keeps freed memory for training would grow by
# the whole model (measured: a stage of a 1.2 GB model at 2.4 GB instead of 1.2).
BUILD_MMAP_THRESHOLD = 1 << 20


_returning = False  # inside returning_memory: a nested one (a build while measuring) leaves it be


@contextmanager
def returning_memory() -> Iterator[None]:
    """Inside, glibc's blocks over BUILD_MMAP_THRESHOLD are mapped alone and unmapped when
    freed; after, what the malloc keeps free is given back too (glibc's heap, the smaller
    objects of the build; all that tcmalloc or jemalloc keep), and glibc's mmap threshold is
    this process's again. Nested, the outermost decides."""
    global _returning
    libc = _glibc()
    if libc is None or _returning:
        yield
        return
    _returning = True
    libc.mallopt(M_MMAP_THRESHOLD, BUILD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        _give_back_free_memory(libc)
        libc.mallopt(M_MMAP_THRESHOLD, _mmap_threshold)
        _returning = False


def _give_back_free_memory(libc: ctypes.CDLL) -> None:
    """Give the memory the running malloc keeps free back to the kernel."""
    if hasattr(libc, "MallocExtension_ReleaseFreeMemory"):  # tcmalloc
        libc.MallocExtension_ReleaseFreeMemory()
    elif hasattr(libc, "mallctl"):  # jemalloc: purge every arena (MALLCTL_ARENAS_ALL)
        libc.mallctl(b"arena.4096.purge", None, None, None, 0)
    else:
        libc.malloc_trim(0)


def rpc_backend_kwargs(
    kind: str,
    role: str,
    rank: int,
    roles: Sequence[str],
    gpus: int,
    environ: Mapping[str, str] | None = None,
) -> dict[str, list[str]]:
    """TensorPipeRpcBackendOptions keyword arguments for the transport lever: this process's
    settings' transports (for_process)."""
    environ = os.environ if environ is None else environ
    settings = for_process(kind, role, rank, roles, gpus, environ)
    if settings.transports is None:
        return {}
    return {"_transports": settings.transports, "_channels": settings.channels}
