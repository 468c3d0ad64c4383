"""When a stage computes: marks on its device's timeline and the busy seconds a step's marks
add up to (each engine's stage records them; the summary reports them)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

# A mark on a stage's timeline: perf_counter seconds on a CPU, a recorded CUDA event on a GPU.
Mark = float | torch.cuda.Event


class Clock:
    """Marks on the timeline of the device a stage computes on: perf_counter seconds on a
    CPU; on a GPU, CUDA events, which mark when the kernels launched before them ran, read
    once per step (`seconds`), so no micro-batch waits for the GPU to be timed."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Mark:
        """Now, on this device's timeline."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, marks: list[Mark]) -> list[float]:
        """The marks as seconds on one timeline (on a GPU, from the first of them, once the
        GPU has passed them all)."""
        if not self.cuda or not marks:
            return list(marks)
        for event in marks:
            event.synchronize()
        return [marks[0].elapsed_time(event) / 1000 for event in marks]


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: time a stage was computing."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def step_seconds(events: list[dict[str, list[float]]]) -> tuple[float, float, float]:
    """One stage's forward, backward and busy seconds in one step, from its micro-batches'
    [start, end] intervals. Backwards of micro-batches interleave in the autograd engine, so
    these are lengths of unions, not sums."""
    forward = [tuple(e["forward"]) for e in events if "forward" in e]
    backward = [tuple(e["backward"]) for e in events if "backward" in e]
    return busy_seconds(forward), busy_seconds(backward), busy_seconds(forward + backward)


def only(
    totals: dict[int, tuple[float, float, float]], step: int | None
) -> dict[int, tuple[float, float, float]]:
    """A stage's `totals` per step, or only step `step`'s: a progress line asks for one step,
    not every step's again."""
    if step is None:
        return dict(totals)
    return {step: totals[step]} if step in totals else {}
