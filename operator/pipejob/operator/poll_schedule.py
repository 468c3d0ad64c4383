"""When the operator polls each running master's /progress (issue 60): the schedule alone; the
reconciler (controller.py) does the polls.

Two kinds of master are polled:
- **alone**: its world's other pods wait for its own check (operator/master_check.py), so the
  poll gates them. Polled ALONE_FIRST after it is seen running, then each ALONE_GROWTH times
  later, up to the routine base interval; always ahead of every routine poll. There are few:
  those created in the last check's time (at 4 jobs/s and a 30 s check, about 120).
- **routine**: its world is whole, and the poll only refreshes status.training. Every
  `max(interval, n / budget)` seconds for n routine masters: at most `budget` polls a second
  (PIPEJOB_POLL_BUDGET, 50), so at 5,000 masters every 100 s rather than every 3 s asked
  and 15-30 s got.

Each entry remembers the master's address and a digest of the last report its job's status
shows, so a poll whose report is unchanged costs one HTTP GET to the master and no API call.
In memory only: a restarted operator learns each master again at its job's next reconcile."""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

ALONE_FIRST = 0.2  # seconds from a lone master's first sight to its first poll
ALONE_GROWTH = 1.5  # each poll that leaves it alone waits this many times longer
BUDGET_ENV = "PIPEJOB_POLL_BUDGET"
DEFAULT_BUDGET = 50.0  # routine polls a second, at most
KEEP = object()  # `saw`'s shown: keep the digest the schedule has


@dataclass(slots=True)
class Entry:
    """One running master: where it answers and its pod's uid, whether its world waits on it,
    the digest of the report its job's status shows (None: unknown), and when it is next due."""

    address: str
    master: str
    alone: bool
    shown: int | None
    due: float
    wait: float  # the alone master's current interval
    turn: int  # new on every reschedule: older heap items for this key are stale
    busy: bool = False  # taken by a poller, not yet `polled`


@dataclass(frozen=True)
class Poll:
    """A due poll, as `take` hands it out."""

    key: Hashable
    address: str
    shown: int | None
    alone: bool
    turn: int


class PollSchedule:
    """The running masters and when each is due (module docstring). Thread-safe: the
    reconciles report what they saw (`saw`, `forget`), pollers `take` and `polled`."""

    def __init__(
        self,
        interval: float,
        budget: float = DEFAULT_BUDGET,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.budget = budget
        self._clock = clock
        self._ready = threading.Condition()
        self._entries: dict[Hashable, Entry] = {}
        self._heaps: dict[bool, list[tuple[float, int, Hashable]]] = {True: [], False: []}
        self._routine = 0  # entries not alone
        self._seq = itertools.count()
        self._closed = False

    def routine_interval(self) -> float:
        """Seconds between two routine polls of one master: the base interval, or longer so
        that all routine masters together take at most `budget` polls a second."""
        with self._ready:
            return self._routine_interval()

    def _routine_interval(self) -> float:
        return max(self.interval, self._routine / self.budget if self.budget > 0 else 0.0)

    def saw(
        self, key: Hashable, address: str | None, master: str, alone: bool, shown: object = KEEP
    ) -> None:
        """A reconcile found `key`'s current master, pod uid `master`, at `address` (None: none
        runs), `alone` or not, its job's status now showing the report of digest `shown` (KEEP:
        as before, if the same master)."""
        if address is None:
            self.forget(key)
            return
        with self._ready:
            entry = self._entries.get(key)
            same = entry is not None and (entry.address, entry.master) == (address, master)
            if entry is not None and same and entry.alone == alone:
                if shown is not KEEP:
                    entry.shown = shown  # type: ignore[assignment]
                return
            now = self._clock()
            kept = entry.shown if same and entry is not None else None
            self._drop(key)
            if alone:
                due, wait = now + ALONE_FIRST, ALONE_FIRST
            else:  # spread over one interval: a burst of whole worlds is not one burst of polls
                self._routine += 1
                due, wait = now + random.uniform(0, self._routine_interval()), 0.0
            digest = kept if shown is KEEP else shown
            new = Entry(address, master, alone, digest, due, wait, 0)  # type: ignore[arg-type]
            self._entries[key] = new
            self._push(key, new)

    def forget(self, key: Hashable) -> None:
        """`key` has no running master any more (or is gone)."""
        with self._ready:
            self._drop(key)

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and not entry.alone:
            self._routine -= 1

    def _push(self, key: Hashable, entry: Entry) -> None:
        entry.turn = next(self._seq)
        heapq.heappush(self._heaps[entry.alone], (entry.due, entry.turn, key))
        self._ready.notify()

    def take(self, timeout: float | None = None) -> Poll | None:
        """The next due poll, a lone master's before any routine one; waits for one to fall
        due. None when closed, or when `timeout` passed first."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._ready:
            while not self._closed:
                now = self._clock()
                for alone in (True, False):
                    poll = self._pop_due(alone, now)
                    if poll is not None:
                        return poll
                wake = self._next_due()
                if deadline is not None:
                    if now >= deadline:
                        return None
                    wake = deadline if wake is None else min(wake, deadline)
                self._ready.wait(None if wake is None else max(wake - now, 0.001))
            return None

    def _pop_due(self, alone: bool, now: float) -> Poll | None:
        heap = self._heaps[alone]
        while heap:
            due, turn, key = heap[0]
            entry = self._entries.get(key)
            if entry is None or entry.turn != turn or entry.alone != alone or entry.busy:
                heapq.heappop(heap)  # stale: rescheduled, forgotten or taken since
                continue
            if due > now:
                return None
            heapq.heappop(heap)
            entry.busy = True
            return Poll(key, entry.address, entry.shown, alone, turn)
        return None

    def _next_due(self) -> float | None:
        dues = [heap[0][0] for heap in self._heaps.values() if heap]
        return min(dues) if dues else None

    def polled(self, poll: Poll) -> None:
        """`poll` is done: schedule its master's next one (unless a reconcile since changed or
        forgot it, which scheduled it afresh)."""
        with self._ready:
            entry = self._entries.get(poll.key)
            if entry is None or not entry.busy or entry.turn != poll.turn:
                return  # forgotten, or made afresh by a reconcile meanwhile
            entry.busy = False
            if entry.alone:
                entry.wait = min(entry.wait * ALONE_GROWTH, max(self.interval, ALONE_FIRST))
                entry.due = self._clock() + entry.wait
            else:
                entry.due = self._clock() + self._routine_interval()
            self._push(poll.key, entry)

    def keys(self) -> set[Hashable]:
        """The jobs whose master is polled."""
        with self._ready:
            return set(self._entries)

    def alone(self) -> int:
        """How many masters are polled as alone now."""
        with self._ready:
            return len(self._entries) - self._routine

    def close(self) -> None:
        """Wake every `take` with None."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def __len__(self) -> int:
        with self._ready:
            return len(self._entries)
