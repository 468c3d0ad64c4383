"""PIPEJOB_TUNING, the performance levers of a training process, and the one that must act
before the process starts: its malloc, preloaded by whoever starts it (`preload_env`: the local
runner, or the trainer re-executing itself). Torch-free: the runner uses it. Why:
docs/architecture.md, "The spec and its validation, part by part"."""

from __future__ import annotations

import ctypes.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

from pipejob.core.contract import TUNING

LEVERS = ("threads", "allocator", "transport")
PRELOAD = "LD_PRELOAD"


@dataclass(frozen=True)
class Malloc:
    """A malloc the allocator lever can choose."""

    name: str
    library: str = ""  # what find_library looks for ("" for the C library's own)
    package: str = ""  # the Debian package that has it


# The allocator lever's choices (issue 35, benchmarks/allocators.py; docs/user-guide.md has the
# table). glibc is the C library's malloc, with the lever's arena and thresholds (tuning.py).
MALLOCS = {
    "tcmalloc": Malloc("tcmalloc", "tcmalloc_minimal", "libtcmalloc-minimal4"),  # no profilers
    "jemalloc": Malloc("jemalloc", "jemalloc", "libjemalloc2"),
    "glibc": Malloc("glibc"),
}
DEFAULT_MALLOC = "tcmalloc"
OPTIONS = {"allocator": tuple(MALLOCS)}  # the levers that take a choice: "allocator=tcmalloc"


def parse(value: str | None) -> dict[str, str]:
    """The levers PIPEJOB_TUNING enables, each with its choice ("" for its default): unset or
    "on" for all, "off" for none, or a comma-separated list ("threads,allocator=tcmalloc").
    A lever or choice it does not know is an error naming the variable."""
    if value is None or value.strip() in ("", "on"):
        return dict.fromkeys(LEVERS, "")
    if value.strip() == "off":
        return {}
    items = (item.partition("=") for item in value.split(",") if item.strip())
    chosen = {lever.strip(): choice.strip() for lever, _, choice in items}
    unknown = set(chosen) - set(LEVERS)
    if unknown:
        raise ValueError(
            f"{TUNING}={value!r}: unknown lever(s) {', '.join(sorted(unknown))};"
            f" use on, off or a comma-separated list of {', '.join(LEVERS)}"
        )
    for lever, choice in chosen.items():
        if choice and choice not in OPTIONS.get(lever, ()):
            known = OPTIONS.get(lever)
            raise ValueError(
                f"{TUNING}={value!r}: {lever}={choice}: "
                + (f"choose one of {', '.join(known)}" if known else f"{lever} takes no choice")
            )
    return chosen


def wanted_malloc(environ: Mapping[str, str]) -> Malloc | None:
    """The malloc PIPEJOB_TUNING asks for; None when the allocator lever is off."""
    enabled = parse(environ.get(TUNING))
    if "allocator" not in enabled:
        return None
    return MALLOCS[enabled["allocator"] or DEFAULT_MALLOC]


def preloaded_malloc(environ: Mapping[str, str]) -> str:
    """The malloc library LD_PRELOAD names already (the user's, or ours), or ""."""
    names = environ.get(PRELOAD, "").replace(":", " ").split()
    return next((n for n in names if "malloc" in os.path.basename(n)), "")


@cache
def library_file(library: str) -> str | None:
    """The file name the dynamic linker knows `library` by (e.g. libjemalloc.so.2), or None
    where this host lacks it."""
    return ctypes.util.find_library(library)


def preload_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to a process's env (`environ`, all of it) so that it starts with the malloc
    PIPEJOB_TUNING asks for: LD_PRELOAD naming it first. Nothing where the lever is off or
    asks for glibc, where LD_PRELOAD names a malloc already (the user's wins), or where this
    host lacks the library (the trainer says so, and keeps glibc's malloc with the lever)."""
    malloc = wanted_malloc(environ)
    if malloc is None or not malloc.library or preloaded_malloc(environ):
        return {}
    found = library_file(malloc.library)
    if found is None:
        return {}
    return {PRELOAD: f"{found} {environ.get(PRELOAD, '')}".strip()}
