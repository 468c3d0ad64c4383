"""Each process's peak memory, so a user sees which member of the world is the tight one.

`peak` runs in any process (the master calls it on every member over RPC, so it needs no
role's objects): the peak resident set (VmHWM, what a container's memory limit counts) and,
where this process uses CUDA, torch's peak of allocated GPU memory. `gather` collects every
member's (for the summary), `refresh` does the same without waiting (at each progress line,
feeding /progress and /metrics)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.futures import Future

    from pipejob.trainer.runtime.monitor import Board
    from pipejob.trainer.runtime.world import Env

# Seconds a member may take to say its peak: a busy member answers from the RPC server's
# thread pool, not from its training loop.
TIMEOUT = 30.0

Peak = dict[str, int]  # rssPeakBytes, and cudaPeakBytes where CUDA is in use
REFRESH_SECONDS = 1.0
_refreshed = float("-inf")  # time.monotonic() of the last refresh


def peak() -> Peak:
    """This process's peak memory so far, in bytes: `rssPeakBytes` (VmHWM) and, once this
    process has used CUDA, `cudaPeakBytes` (torch.cuda.max_memory_allocated over its GPUs)."""
    figures = {"rssPeakBytes": status_kb("VmHWM") * 1024}
    torch = sys.modules.get("torch")  # a process that never imported torch used no GPU
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        count = torch.cuda.device_count()
        figures["cudaPeakBytes"] = sum(torch.cuda.max_memory_allocated(d) for d in range(count))
    return figures


def status_kb(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM, ...), in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise LookupError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start the peak over from now: Linux resets VmHWM to the current resident set when "5"
    is written to clear_refs (and torch's CUDA peak, where CUDA is in use)."""
    Path("/proc/self/clear_refs").write_text("5")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def gather(env: Env) -> dict[str, Peak]:
    """Every member's peak, in rank order, this process's own included; a member that does
    not answer in time is left out (its failure is reported where it happens)."""
    import torch.distributed.rpc as rpc

    asked = {
        name: rpc.rpc_async(name, peak, timeout=TIMEOUT)
        for name in env.world
        if name != env.rpc_name
    }
    figures = {}
    for name in env.world:
        try:
            figures[name] = peak() if name == env.rpc_name else asked[name].wait()
        except RuntimeError:
            continue
    return figures


def refresh(env: Env, board: Board) -> None:
    """Ask every member for its peak without waiting, at most once every REFRESH_SECONDS
    (a progress line may come every few milliseconds); each answer goes to `board`
    (monitor.Board.memory) when it comes."""
    import torch.distributed.rpc as rpc

    global _refreshed
    if time.monotonic() - _refreshed < REFRESH_SECONDS:
        return
    _refreshed = time.monotonic()
    board.memory(env.rpc_name, peak())
    for name in env.world:
        if name != env.rpc_name:
            future = rpc.rpc_async(name, peak, timeout=TIMEOUT)
            future.add_done_callback(lambda f, name=name: _post(board, name, f))


def _post(board: Board, name: str, future: Future) -> None:
    try:
        board.memory(name, future.wait())
    except Exception:  # a callback's error would only be logged by torch
        pass  # a member gone or slow: no figure this time


def megabytes(figures: Peak) -> str:
    """`figures` as a short text: "812 MB" and, with a GPU, "812 MB, GPU 2048 MB"."""
    text = f"{figures['rssPeakBytes'] / 1e6:.0f} MB"
    if "cudaPeakBytes" in figures:
        text += f", GPU {figures['cudaPeakBytes'] / 1e6:.0f} MB"
    return text
