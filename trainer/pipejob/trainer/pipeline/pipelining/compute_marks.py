"""When a pipelining stage computes: each training forward and backward of a micro-batch
marked on its device's timeline (timing.Clock), by step, and folded into the step's busy
seconds (timing.busy_seconds) once its round has ended, for the summary's per-stage times
and bubble."""

from __future__ import annotations

import threading
from typing import Any

import torch

from pipejob.trainer.pipeline.timing import Clock, busy_seconds, only

Pairs = list[tuple[Any, Any]]  # [start, end] marks of micro-batches' forwards or backwards


class ComputeMarks:
    """A stage's marks. `step` is the step whose forwards and backwards are marked (None:
    none, as in an evaluation)."""

    def __init__(self, device: torch.device):
        self._clock = Clock(device)
        self._lock = threading.Lock()
        self.step: int | None = None
        self._training = False  # a training round is running (its step's marks still come)
        # Per step, its forwards' and its backwards' [start, end] marks: kept as pairs in
        # two lists, not an entry per interval, as a tiny stage's step pays for each.
        self._pairs: dict[int, tuple[Pairs, Pairs]] = {}
        self._totals: dict[int, tuple[float, float, float]] = {}

    def begin(self, step: int | None, training: bool = False) -> None:
        """Mark the forwards and backwards from here on as step `step`'s (None: none), in a
        training round (`training`) or not."""
        with self._lock:
            if self.step is not None and self.step != step:
                self._fold(self.step)
            self.step, self._training = step, training

    def ended(self) -> None:
        """The training rounds of a call have ended: their step can be folded."""
        with self._lock:
            self._training = False

    def mark(self) -> Any:
        """A mark of now, where a forward or backward of one micro-batch starts (`interval`)."""
        return self._clock.mark()

    def interval(self, what: str, start: Any) -> None:
        """Mark a forward or backward (`what`) of one micro-batch, from `start` (`mark`) to
        now, in its step's marks."""
        end = self._clock.mark()
        with self._lock:
            if self.step is not None:
                pairs = self._pairs.get(self.step)
                if pairs is None:
                    pairs = self._pairs[self.step] = ([], [])
                pairs[what != "forward"].append((start, end))

    def timings(self, step: int | None = None) -> dict[int, tuple[float, float, float]]:
        """Per step (every one folded, or only `step`): its forward, backward and busy
        seconds. A round still running (the next step, sent early) is folded once it has
        ended."""
        with self._lock:
            if self.step is not None and not self._training:
                self._fold(self.step)
                self.step = None
            return only(self._totals, step)

    def _fold(self, step: int) -> None:
        """Step `step`'s forward, backward and busy seconds: lengths of unions of its
        intervals (backwards of micro-batches interleave in the autograd engine)."""
        forward, backward = self._pairs.pop(step, ([], []))
        if self._clock.cuda:
            at = iter(self._clock.seconds([m for pair in forward + backward for m in pair]))
            forward = [(next(at), next(at)) for _ in forward]
            backward = [(next(at), next(at)) for _ in backward]
        self._totals[step] = (
            busy_seconds(forward),
            busy_seconds(backward),
            busy_seconds(forward + backward),
        )
