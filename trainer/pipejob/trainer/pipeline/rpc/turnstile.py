"""The order a stage of the rpc engine computes its micro-batches in, whatever the order they
reach its RPC threads in (pipeline/rpc/stage.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Turnstile:
    """Lets callers through one at a time in micro-batch order: (step, 0), (step, 1), ...; a
    later step starts again at 0 (the master begins a step's forwards once the last step's
    have all ended). A step's forwards reach a stage's RPC threads in any order; run as they
    came, stage k could hold back micro-batch 0, which stage k + 1 needs first.

    A caller whose forward fails passes the turn on, so a failure never leaves the
    micro-batches after it waiting. The stage before sends a stage its micro-batches in
    order, so the one whose turn it is has always been sent; a turn that does not come
    within `timeout` is an error, not a hang."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._changed = threading.Condition()
        self._step, self._next = -1, 0  # the last step seen, and its next micro-batch

    def _due(self, step: int, index: int) -> bool:
        if step == self._step:
            return index == self._next
        return step > self._step and index == 0

    @contextmanager
    def turn(self, step: int, index: int) -> Iterator[None]:
        with self._changed:
            if not self._changed.wait_for(lambda: self._due(step, index), self.timeout):
                raise TimeoutError(
                    f"micro-batch {index} of step {step} waited {self.timeout:g}s for its turn"
                    f" (the stage last ran micro-batch {self._next - 1} of step {self._step})"
                )
        try:
            yield
        finally:
            with self._changed:
                self._step, self._next = step, index + 1
                self._changed.notify_all()
