"""A stage's order on the eager path: the micro-batches of a step call each of its modules
in micro-batch order (the k-th call of a module by micro-batch i waits for the k-th call by
every earlier micro-batch of the step, or for that micro-batch's forward to have ended
without it), so BatchNorm's statistics and dropout's draws are the same on every run,
whatever order the master's threads reach the stage in."""

from __future__ import annotations

import threading

Key = tuple[str, int]  # a module's name, and which of a micro-batch's calls of it


class Turns:
    """Which micro-batches (numbered across steps: step x micro-batches + i) have made each
    call, and which have ended their forward."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._made: dict[Key, set[int]] = {}
        self._ended: set[int] = set()
        self._first = 0  # the first micro-batch of the newest step seen

    def wait(self, key: Key, first: int, number: int, timeout: float) -> None:
        """Until micro-batches first .. number - 1 have each made call `key` or ended."""
        with self._changed:
            if first > self._first:  # a new step: what the old ones did is no longer asked
                self._first = first
                self._made = {k: {n for n in v if n >= first} for k, v in self._made.items()}
                self._ended = {n for n in self._ended if n >= first}
            if not self._changed.wait_for(lambda: self._ready(key, first, number), timeout):
                raise TimeoutError(
                    f"micro-batch {number - first} waited {timeout:.0f}s for an earlier one's"
                    f" call of {key[0]}"
                )

    def _ready(self, key: Key, first: int, number: int) -> bool:
        made = self._made.get(key, set())
        return all(n in made or n in self._ended for n in range(first, number))

    def made(self, key: Key, number: int) -> None:
        with self._changed:
            self._made.setdefault(key, set()).add(number)
            self._changed.notify_all()

    def ended(self, number: int) -> None:
        """Micro-batch `number`'s forward has ended on the master: it makes no more calls."""
        with self._changed:
            self._ended.add(number)
            self._changed.notify_all()
