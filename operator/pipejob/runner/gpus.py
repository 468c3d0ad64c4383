"""GPUs for a job run as local processes: how many this machine has (`detect`, without torch:
the runner is torch-free), and which each process sees (`place`), as a cluster's device
plugin would hand them out; shared round-robin where there are fewer, never by two members of
one NCCL group. docs/user-guide.md, "GPU jobs", tells what a user sees."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipejob.core.plan import Process

VISIBLE = "CUDA_VISIBLE_DEVICES"
DEVICES, NODE = Path("/dev"), re.compile(r"nvidia\d+")  # one node per GPU
DRIVER = Path("/proc/driver/nvidia/gpus")  # one folder per GPU of the host (its PCI address)


class NotEnoughGPUs(ValueError):
    """The job cannot run with this machine's GPUs; the message says why, with the numbers."""


def detect(
    environ: Mapping[str, str] = os.environ, devices: Path = DEVICES, driver: Path = DRIVER
) -> list[str]:
    """This machine's usable GPUs, as CUDA_VISIBLE_DEVICES entries: the caller's own, else
    as many as `nvidia-smi -L` lists, else /dev/nvidia<N> nodes (a container has those of
    its GPUs only), else the driver's list."""
    if VISIBLE in environ:
        usable = []
        for entry in (e.strip() for e in environ[VISIBLE].split(",")):
            if not entry or entry.startswith("-"):  # CUDA stops there ("-1" hides them all)
                break
            usable.append(entry)
        return usable
    counts = (
        _listed_by_smi(),
        _entries_matching(devices, NODE),
        _entries_matching(driver, re.compile(".+")),
    )
    return [str(i) for i in range(next((n for n in counts if n), 0))]


def _listed_by_smi() -> int:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listed.splitlines())


def _entries_matching(folder: Path, name: re.Pattern[str]) -> int:
    try:
        return sum(1 for entry in folder.iterdir() if name.fullmatch(entry.name))
    except OSError:
        return 0


@dataclass(frozen=True)
class GpuPlacement:
    visible: dict[int, str]  # rank -> CUDA_VISIBLE_DEVICES of each process that has GPUs
    note: str | None = None  # one line when processes share GPUs


def place(processes: Sequence[Process], gpus: Sequence[str]) -> GpuPlacement:
    """Which of `gpus` each process sees: its own where there are enough, else the least
    used (round-robin), never one that another member of its NCCL group holds.
    NotEnoughGPUs where that cannot be done."""
    asking = [p for p in processes if p.gpus > 0]
    wanted = sum(p.gpus for p in asking)
    if not asking:
        return GpuPlacement({})
    have = f"this machine has {_gpus_phrase(len(gpus))}"
    if not gpus:
        raise NotEnoughGPUs(
            f"the job asks for {_gpus_phrase(wanted)} and {have} (no NVIDIA driver"
            f" found, or {VISIBLE} hides them); run it where there are GPUs,"
            " or set its GPU fields to 0 to train on CPU"
        )
    load = dict.fromkeys(gpus, 0)
    held: dict[str, dict[str, str]] = {}  # NCCL group -> GPU -> the member holding it
    visible = {}
    for p in asking:
        group = p.seat.group if p.seat is not None and p.seat.backend == "nccl" else None
        mates = held.setdefault(group, {}) if group else {}
        if p.gpus > len(gpus):
            raise NotEnoughGPUs(f"{p.rpc_name} asks for {_gpus_phrase(p.gpus)} and {have}")
        free = [g for g in gpus if g not in mates]
        if len(free) < p.gpus:
            other = mates[min(gpus, key=load.__getitem__)]
            raise NotEnoughGPUs(
                f"{other} and {p.rpc_name} would share a GPU: the job asks for"
                f" {_gpus_phrase(wanted)} and {have}, and NCCL cannot run two members of one group"
                f" ({group}) on one GPU; run it where each has its own, with fewer members"
                " (trainers or replicas), or, for a HybridJob, with backend: gloo"
            )
        chosen = sorted(free, key=load.__getitem__)[: p.gpus]  # stable: lowest index first
        for g in chosen:
            load[g] += 1
            mates[g] = p.rpc_name
        visible[p.rank] = ",".join(chosen)
    if wanted <= len(gpus):
        return GpuPlacement(visible)
    sharing: dict[str, list[str]] = {}
    for p in asking:
        sharing.setdefault(visible[p.rank], []).append(p.rpc_name)
    shared = "; ".join(f"{', '.join(names)} on {VISIBLE}={v}" for v, names in sharing.items())
    return GpuPlacement(
        visible,
        f"the job asks for {_gpus_phrase(wanted)} and {have}: its processes"
        f" share them ({shared}), which trains, but slower",
    )


def _gpus_phrase(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")
