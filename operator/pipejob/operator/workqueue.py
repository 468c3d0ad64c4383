"""The reconciles' queue, as client-go's workqueue: a job is in it at most once however many
events name it, one worker at a time reconciles it, and a job named again while a worker has
it is queued once more when that reconcile ends (it reads the job afresh, so one reconcile
answers every event that came before it starts).

Without it (issue 60) each watch event was a reconcile waiting in kopf's few handler threads:
a LIST of a thousand jobs' pods queued thousands of reconciles, and a job created behind them
waited minutes for its first. Here the backlog is at most one entry a job, and a job no
reconcile has seen yet (no status: just created) goes ahead of the jobs already running, but
never more than NEW_IN_A_ROW times in a row while others wait: during a long burst of new
jobs (5,000 created at 2.5/s) the running jobs' status updates (Pending to Running) would
otherwise wait for the burst's end."""

from __future__ import annotations

import threading
from collections.abc import Hashable

NEW_IN_A_ROW = 4  # new jobs taken in a row while another job waits; then that one


class WorkQueue:
    def __init__(self) -> None:
        lock = threading.Lock()
        self._ready = threading.Condition(lock)  # something queued, or closed: for workers
        self._idle = threading.Condition(lock)  # nothing queued or active: for `drained`
        # Two lanes, each in arrival order: the new jobs', then everyone else's. A job's entry
        # is whether its reconcile polls the master's progress.
        self._new: dict[Hashable, bool] = {}
        self._rest: dict[Hashable, bool] = {}
        self._active: set[Hashable] = set()  # jobs a worker is reconciling
        self._again: dict[Hashable, bool] = {}  # jobs named while active: queued at done()
        self._closed = False
        self._streak = 0  # new jobs taken in a row while the rest waited

    def add(self, key: Hashable, poll: bool = False, new: bool = False) -> None:
        """Queue `key` (a poll if any of its queued triggers asked for one); ahead of the
        rest if `new`. Never blocks for long: kopf's handlers call it on its event loop."""
        with self._ready:
            if key in self._active:
                self._again[key] = self._again.get(key, False) or poll
                return
            for lane in (self._new, self._rest):
                if key in lane:
                    lane[key] |= poll
                    return
            (self._new if new else self._rest)[key] = poll
            self._ready.notify()

    def get(self) -> tuple[Hashable, bool] | None:
        """The next job and whether to poll it, marked active until `done`; waits for one.
        None once the queue is closed."""
        with self._ready:
            self._ready.wait_for(lambda: self._closed or self._new or self._rest)
            if self._closed:
                return None
            first = self._new and (not self._rest or self._streak < NEW_IN_A_ROW)
            self._streak = self._streak + 1 if first and self._rest else 0
            lane = self._new if first else self._rest
            key = next(iter(lane))
            self._active.add(key)
            return key, lane.pop(key)

    def done(self, key: Hashable) -> None:
        """The worker's reconcile of `key` ended: queue it again if it was named meanwhile."""
        with self._ready:
            self._active.discard(key)
            if key in self._again:
                self._rest[key] = self._again.pop(key)
                self._ready.notify()
            elif not (self._new or self._rest or self._active):
                self._idle.notify_all()

    def drained(self, timeout: float) -> bool:
        """Wait until nothing is queued or being reconciled; False if `timeout` passed first."""
        with self._idle:
            return self._idle.wait_for(
                lambda: not (self._new or self._rest or self._active), timeout
            )

    def close(self) -> None:
        """Wake every waiting worker with None; what is still queued is dropped."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def __len__(self) -> int:
        """Entries held: queued, active and to be queued again."""
        with self._ready:
            return len(self._new) + len(self._rest) + len(self._active) + len(self._again)
