"""The watchdog: a member that stops answering, or a world whose progress stops, is found
within a bound and named. Every member beats over HTTP to the master's monitor port,
independent of torch RPC; the master also watches the world's progress (its calls and the
calls each member served). Whoever notices exits STALLED with a one-line termination
message. Why and how: docs/architecture.md, "The watchdog"."""

from __future__ import annotations

import http.client
import json
import os
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import TypedDict

from pipejob.core import contract as c
from pipejob.trainer.runtime import monitor, rpc_ledger
from pipejob.trainer.runtime.world import Env, log, write_termination_message

# The phases after which nobody needs watching: the master is leaving anyway.
_OVER = ("finished", "failed")


def bound(env: Env, board: monitor.Board) -> float:
    """Seconds of silence that make a member stalled: spec.watchdog.seconds, else
    max(60 s, 10x the longest measured step), at most 600 s."""
    if env.spec.watchdog is not None:
        return float(env.spec.watchdog.seconds)
    derived = c.WATCHDOG_FACTOR * board.longest_step
    return min(c.WATCHDOG_CAP, max(c.WATCHDOG_FLOOR, derived))


def interval(seconds: float) -> float:
    """How often members beat and the master looks: about ten times per bound."""
    return min(2.0, max(0.2, seconds / 10))


def member_label(name: str, pod: str | None, pid: int | None) -> str:
    """A member as the watchdog names it: "stage1 (pod x-stage-1)", "stage1 (pid 4242)"."""
    if pod:
        return f"{name} (pod {pod})"
    return f"{name} (pid {pid})" if pid else name


def stall(env: Env, message: str) -> None:
    """Say it in one line and leave at once: the main thread may never come back."""
    line = f"{c.STALLED_PREFIX} {message}"
    log(env, f"error: {message}")
    write_termination_message(line)
    monitor.board().phase("failed", line)
    sys.stdout.flush()
    os._exit(c.ExitCode.STALLED)


# The call a member waits on, as a heartbeat says it: (members, what, seconds so far).
Waits = tuple[list[str], str, float]


class Heartbeat(TypedDict):
    """What a member posts (JSON): who it is, where, the calls it has served and made, and
    the oldest call of its own it waits on."""

    member: str
    pod: str | None
    pid: int
    ended: int
    waits: Waits | None


class HeartbeatReply(Heartbeat):
    """The master's answer (JSON): its own heartbeat, where the world is, and the bound
    it watches with."""

    phase: str | None
    step: int
    seconds: float


def _heartbeat(env: Env) -> Heartbeat:
    """The heartbeat this member posts: who it is, where, how many calls it has served and
    made, and the oldest call of its own it waits on (whom, for what, since how long)."""
    oldest = next(iter(rpc_ledger.LEDGER.outstanding()), None)
    waits = (
        None if oldest is None else (list(oldest.to), oldest.what, time.monotonic() - oldest.since)
    )
    return Heartbeat(
        member=env.rpc_name,
        pod=os.environ.get(c.POD_NAME) or None,
        pid=os.getpid(),
        ended=rpc_ledger.LEDGER.ended(),
        waits=waits,
    )


def _waits(waits: object) -> tuple[tuple[str, ...], str, float] | None:
    """The call a member's heartbeat says it waits on (its `waits`, as received), as
    (members, what, seconds), or None."""
    if not (isinstance(waits, list) and len(waits) == 3):
        return None
    to, what, seconds = waits
    if not (to and isinstance(to, list) and isinstance(what, str)):
        return None
    return tuple(map(str, to)), what, float(seconds) if isinstance(seconds, int | float) else 0.0


@dataclass(frozen=True)
class Seen:
    """A member's last heartbeat: when (monotonic), who, and where the world was then."""

    at: float
    pod: str | None
    pid: int | None
    phase: str | None
    step: int
    ended: int = 0  # the calls it had served (and made) by then
    waits: tuple[tuple[str, ...], str, float] | None = None  # the call it waited on (`_waits`)


class Members:
    """The master's side: when it last heard from each member, and the verdict."""

    def __init__(
        self, env: Env, board: monitor.Board, ledger: rpc_ledger.Ledger = rpc_ledger.LEDGER
    ):
        self.env, self.board, self.ledger = env, board, ledger
        self.lock = threading.Lock()
        self.seen: dict[str, Seen] = {}
        # When every member was known alive: the preflight passed (each member checked in,
        # its heartbeats already started) or, without a preflight, training began.
        self.formed: float | None = None
        # The world's progress as last seen, and when it last moved (`stuck`).
        self.marker: tuple[str | None, int, int | None, int, int] | None = None
        self.moved = time.monotonic()

    def heartbeat(self, report: object) -> HeartbeatReply:
        """One member's heartbeat, as received (the monitor's HTTP thread calls this: a
        `Heartbeat` unless something else posted); the reply tells the member where the
        master is and the bound it watches with."""
        progress = self.board.progress()
        name = report.get("member") if isinstance(report, dict) else None
        if name in self.env.world[1:]:
            pod, pid, ended = report.get("pod"), report.get("pid"), report.get("ended")
            seen = Seen(
                time.monotonic(),
                pod if isinstance(pod, str) else None,
                pid if isinstance(pid, int) else None,
                progress.phase,
                progress.step,
                ended if isinstance(ended, int) else 0,
                _waits(report.get("waits")),
            )
            with self.lock:
                self.seen[name] = seen
        return HeartbeatReply(
            **_heartbeat(self.env),
            phase=progress.phase,
            step=progress.step,
            seconds=bound(self.env, self.board),
        )

    def silent(self, now: float) -> str | None:
        """What is wrong if a member has been silent for longer than the bound, else None.
        A member never heard from is waited for by the rendezvous until `formed`."""
        limit = bound(self.env, self.board)
        progress = self.board.progress()
        passed = progress.preflight is not None and progress.preflight.ok
        if self.formed is None and (passed or progress.phase == "training"):
            self.formed = now
        with self.lock:
            for name in self.env.world[1:]:
                seen = self.seen.get(name)
                if seen is not None and now - seen.at > limit:
                    return (
                        f"{member_label(name, seen.pod, seen.pid)} stopped answering: no heartbeat"
                        f" for {now - seen.at:.0f} s, last seen in {seen.phase} at step"
                        f" {seen.step}"
                    )
                if seen is None and self.formed is not None and now - self.formed > limit:
                    into = now - self.formed
                    return (
                        f"{name} stopped answering: no heartbeat at all for {into:.0f} s since"
                        f" the world formed"
                    )
        return None

    def named(self, name: str) -> str:
        with self.lock:
            seen = self.seen.get(name)
        return member_label(name, seen.pod, seen.pid) if seen else name

    def stuck(self, now: float) -> str | None:
        """What the world waits on if it has made no progress for longer than the bound
        while the master waited on calls, else None. A member going silent is left to
        `silent`, which names it as not answering."""
        limit = bound(self.env, self.board)
        progress = self.board.progress()
        waiting = self.ledger.outstanding()
        with self.lock:
            served = sum(seen.ended for seen in self.seen.values())
            quiet = any(now - seen.at > limit / 2 for seen in self.seen.values())
        marker = (
            progress.phase,
            progress.step,
            progress.evalStep,
            self.ledger.ended(),
            served,
        )
        # Only training is judged: building and measuring a big model's stages, before it,
        # are single calls that may rightly run longer than the bound.
        training = progress.phase == "training"
        if marker != self.marker or not waiting or self.formed is None or not training:
            self.marker, self.moved = marker, now
            return None
        idle = now - self.moved
        if idle <= limit or quiet:
            return None
        first = waiting[0]
        others = dict.fromkeys(m for call in waiting[1:] for m in call.to if m not in first.to)
        also = f"; also on {', '.join(map(self.named, others))}" if others else ""
        return (
            f"no progress for {idle:.0f} s in {progress.phase} at step"
            f" {progress.step}: waiting on {', '.join(self.named(m) for m in first.to)}"
            f" for {first.what} (called {now - first.since:.0f} s ago)"
            f"{self.passed_on(first.to)}{also}"
        )

    def passed_on(self, to: tuple[str, ...]) -> str:
        """Where a call the master waits on waits in turn: the calls each member it went to
        makes and waits on, followed member by member (the rpc engine's first stage waits on
        the next, which waits on the one after it...), as ", which waits on ..." each."""
        said, passed = "", {self.env.world[0]}
        while len(to) == 1 and to[0] not in passed:
            passed.add(to[0])
            with self.lock:
                seen = self.seen.get(to[0])
            if seen is None or seen.waits is None:
                break
            to, what, seconds = seen.waits
            whom = ", ".join(map(self.named, to))
            said += f", which waits on {whom} for {what} ({seconds:.0f} s)"
        return said

    def watch(self) -> None:
        looked = time.monotonic()
        while self.board.progress().phase not in _OVER:
            every = interval(bound(self.env, self.board))
            time.sleep(every)
            now = time.monotonic()
            # Woken late, this process itself did not run (a long call holding the GIL, an
            # overloaded node): the heartbeats queued meanwhile get a turn before any verdict.
            starved, looked = now - looked > 3 * every, now
            message = None if starved else self.silent(now) or self.stuck(now)
            if message is not None and self.board.progress().phase not in _OVER:
                stall(self.env, message)


def _post(url: str, body: bytes, timeout: float) -> HeartbeatReply:
    """Post a heartbeat; the master's reply, a JSON object (its fields read with care)."""
    # No proxy: the master is in the same network, whatever HTTP_PROXY the image sets.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with opener.open(request, timeout=timeout) as response:
            reply = json.load(response)
    except http.client.HTTPException as e:  # a master that died mid-reply cut it short
        raise ConnectionError(f"a heartbeat's reply was cut short: {e!r}") from e
    if not isinstance(reply, dict):
        raise ValueError("a heartbeat's reply is a JSON object")
    return reply


def beat(env: Env) -> None:
    """A member's side: beat until the process ends; name the master once it has stopped
    answering for longer than the bound. A master never heard from is named only once it
    took heartbeats without answering them for that long (its monitor accepts connections,
    so it started, and then froze); while it refuses them, it has not started yet, and the
    rendezvous waits for it with its own deadline."""
    url = f"http://{env.master_addr}:{env.monitor_port}{c.HEARTBEAT_PATH}"
    seconds = float(env.spec.watchdog.seconds if env.spec.watchdog else c.WATCHDOG_FLOOR)
    heard: tuple[float, HeartbeatReply] | None = None
    unanswered: float | None = None  # never heard: since when heartbeats went unanswered
    looked = time.monotonic()
    while True:
        timeout = min(10.0, max(2.0, seconds / 3))
        # Woken late, this process itself did not run: the master gets another chance.
        now = time.monotonic()
        if now - looked > timeout + 3 * interval(seconds) + 2.0:
            heard = (now, heard[1]) if heard is not None else None
            unanswered = None
        looked = now
        sent = time.monotonic()
        try:
            reply = _post(url, json.dumps(_heartbeat(env)).encode(), timeout)
            heard = (time.monotonic(), reply)
            if isinstance(reply.get("seconds"), int | float):
                seconds = float(reply["seconds"])
        except (OSError, ValueError) as e:
            silent = time.monotonic() - heard[0] if heard else 0.0
            if heard is not None and silent > seconds:
                last = heard[1]
                master = member_label(env.world[0], last.get("pod"), last.get("pid"))
                stall(
                    env,
                    f"{master} stopped answering: no reply to heartbeats for"
                    f" {silent:.0f} s, last seen in {last.get('phase')} at step"
                    f" {last.get('step')}",
                )
            if heard is None and _timed_out(e):
                unanswered = sent if unanswered is None else unanswered
                if time.monotonic() - unanswered > seconds:
                    stall(
                        env,
                        f"{env.world[0]} stopped answering: no reply to heartbeats for"
                        f" {time.monotonic() - unanswered:.0f} s, none answered"
                        " since it started",
                    )
        time.sleep(interval(seconds))


def _timed_out(error: BaseException) -> bool:
    """Whether a heartbeat reached a listening master that did not answer in time (not
    refused: nothing listening yet)."""
    return isinstance(error, TimeoutError) or isinstance(
        getattr(error, "reason", None), TimeoutError
    )


def start(env: Env, board: monitor.Board | None = None) -> None:
    """Watch the world from this process: the master (with its served `board`) listens for
    heartbeats and judges them; every other member beats."""
    if env.rank == 0:
        assert board is not None
        members = Members(env, board)
        board.on_heartbeat = members.heartbeat
        rpc_ledger.trace(env.world[1:])  # the calls the master makes: whom it waits on
        target = members.watch
    else:
        rpc_ledger.trace([m for m in env.world[1:] if m != env.rpc_name])  # to say what it waits on
        target = lambda: beat(env)  # noqa: E731
    threading.Thread(target=target, name="pipejob-watchdog", daemon=True).start()
    if env.rank == 0:
        said = (
            f"{env.spec.watchdog.seconds} s (spec.watchdog.seconds)"
            if env.spec.watchdog
            else f"max({c.WATCHDOG_FLOOR:g} s, {c.WATCHDOG_FACTOR:g}x the slowest step),"
            f" at most {c.WATCHDOG_CAP:g} s"
        )
        log(
            env,
            f"watchdog: a member that stops answering, or a world that makes no progress,"
            f" for {said} fails the job",
        )
