"""When an rpc-engine stage computes: the marks of each micro-batch's forward and backward on
its device's timeline, folded into per-step seconds once a later step starts (the summary's
per-stage time and bubble)."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch

from pipejob.trainer.pipeline.timing import Clock, only, step_seconds


class StageTimes:
    """Marks per (step, (round, micro-batch)): a forward's [start, end], and the "start" and
    "end" notes of its backward (RpcStage._time_backward's hooks)."""

    def __init__(self, device: torch.device):
        self.clock = Clock(device)
        self._lock = threading.Lock()
        self._events: dict[tuple[int, Any], dict[str, list[Any]]] = defaultdict(dict)
        self._totals: dict[int, tuple[float, float, float]] = {}

    def forward(self, step: int, key: Any, start: Any, end: Any) -> None:
        """A training forward's marks; the steps before `step` are folded (finished)."""
        with self._lock:
            self._fold(before=step)
            self._events[step, key]["forward"] = [start, end]

    def note(self, key: tuple[int, Any], what: str) -> None:
        """A backward's "start" or "end" now."""
        mark = self.clock.mark()
        with self._lock:
            self._events[key].setdefault(what, []).append(mark)

    def timings(self, step: int | None = None) -> dict[int, tuple[float, float, float]]:
        """Forward, backward and busy seconds per finished step (or only `step`'s)."""
        with self._lock:
            self._fold(before=float("inf"))
            return only(self._totals, step)

    def _fold(self, before: float) -> None:
        for step in sorted({s for s, _ in self._events if s < before}):
            events = [self._events.pop(k) for k in list(self._events) if k[0] == step]
            self._totals[step] = step_seconds(self._intervals(events))

    def _intervals(self, events: list[dict[str, list[Any]]]) -> list[dict[str, list[float]]]:
        """A step's marks as [start, end] seconds of each micro-batch's forward and backward
        (which starts at its last "start" note, or its first "end" one, and ends at its
        last "end" note)."""
        marks = [m for e in events for what in ("forward", "start", "end") for m in e.get(what, [])]
        at = dict(zip(map(id, marks), self.clock.seconds(marks), strict=True))
        intervals = []
        for e in events:
            times = {
                what: [at[id(m)] for m in e.get(what, [])] for what in ("forward", "start", "end")
            }
            interval = {"forward": times["forward"]} if times["forward"] else {}
            notes = times["start"][-1:] or times["end"][:1]
            if notes:
                interval["backward"] = [notes[0], max([notes[0], *times["end"]])]
            intervals.append(interval)
        return intervals
