"""One lock per job, for the reconciles and the polls that may reconcile (controller.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator


class KeyedLocks:
    """One lock per key, made when a thread first asks for it and dropped when no thread
    holds it or waits for it: the map holds the jobs being reconciled, never every job the
    operator has seen."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Hashable, tuple[threading.Lock, int]] = {}  # key -> (lock, users)

    @contextlib.contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key, (None, 0))
            lock = lock or threading.Lock()
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)
