"""An emulated cluster controller's life: a daemon thread that runs `tick` every `every`
seconds between `with` and its end, and says (and retries) when the API fails it."""

from __future__ import annotations

import sys
import threading
from typing import Self

from harness.client import ApiError


class Controller:
    name = "controller"  # in its thread's name and its messages

    def __init__(self, every: float):
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self._tick()
            except (ApiError, OSError) as e:
                print(f"[{self.name}] {e}; retrying", file=sys.stderr, flush=True)

    def _tick(self) -> None:
        raise NotImplementedError
