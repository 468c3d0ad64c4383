"""The embedded default (`pipejob run`): a job's world plan as local processes on loopback, each
with exactly the env a pod would get (plus the caller's, for PATH and friends), their output
streamed with role prefixes. As under the operator, the master's exit decides and any other
process dying stops everything (an RPC world cannot re-admit a member); docs/user-guide.md.
Where a kind's master checks what it can alone (Kind.checks_first), the master starts first
and the others once it has: its refusal comes before any other process starts."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from pipejob.core import master_first, tuning_levers
from pipejob.core.contract import BROKEN_PREFIX, TERMINATION_LOG, TUNING, Progress
from pipejob.core.plan import (
    TRAINER_MODULE,
    Ports,
    Process,
    gpus_for,
    groups,
    members,
    plan_world,
)
from pipejob.core.spec import Job
from pipejob.runner import gpus

LOOPBACK = "127.0.0.1"
POLL_SECONDS = 0.1
# After a first failure, how long the others get to end too: the one that failed first by
# cause (not the peers that only lost it) is the one the runner names.
SETTLE_SECONDS = 3.0


def free_ports(count: int) -> list[int]:
    """Distinct ports free on loopback now (held open together so they differ), drawn at
    random below the kernel's ephemeral range. A port the kernel hands out (a bind to port 0)
    is one of that range, where every outgoing connection takes its local port: another
    world's connection could take it before this world's master binds it ("Address already
    in use"). Where the range leaves too little below it, the kernel's."""
    low = _ephemeral_start()
    pool = range(low // 2, low) if low >= 8192 else None
    draw = random.SystemRandom()  # forked processes share `random`'s state
    socks: list[socket.socket] = []
    draws = 200 if pool else 0  # then the kernel's
    try:
        while len(socks) < count:
            s = socket.socket()
            try:
                s.bind((LOOPBACK, draw.choice(pool) if draws > 0 else 0))
            except OSError:  # taken: draw again
                s.close()
            else:
                socks.append(s)
            draws -= 1
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class Running:
    process: Process
    popen: subprocess.Popen
    pump: threading.Thread
    message_file: Path  # where it leaves its termination message

    @property
    def name(self) -> str:
        return self.process.rpc_name

    def termination_message(self, code: int) -> str:
        """Why it failed, in its own words (its termination message), or ""."""
        try:
            return self.message_file.read_text().strip() if code > 0 else ""
        except OSError:
            return ""

    def ending(self, code: int) -> str:
        """How it ended, and in its own words when it said why."""
        words = self.termination_message(code)
        return describe_exit(code) + (f": {words}" if words else "")


class World:
    """The started processes of one job and their output. When one fails, the runner says
    which, how, and why in its own words (its termination message, a file per process)."""

    def __init__(self, out: TextIO, directory: Path | None = None):
        self.out = out
        self.directory = directory
        self.lock = threading.Lock()
        self.members: list[Running] = []
        self._messages = tempfile.TemporaryDirectory(prefix="pipejob-run-")

    def say(self, message: str) -> None:
        with self.lock:
            self.out.write(f"pipejob: {message}\n")
            self.out.flush()

    def _pump(self, stream: Iterable[str], prefix: str) -> None:
        for line in stream:
            text = line.rstrip("\n")
            with self.lock:
                self.out.write(f"{prefix} | {text}\n")
                self.out.flush()

    def start(
        self, processes: list[Process], visible: dict[int, str] | None = None, width: int = 0
    ) -> None:
        """Start every process; `visible`: CUDA_VISIBLE_DEVICES by rank (gpus.place);
        `width`: of the names that prefix their lines (default: the longest of these)."""
        width = width or max(len(p.rpc_name) for p in processes)
        extra = {"PYTHONUNBUFFERED": "1"}
        if self.directory is not None:
            extra["PYTHONPATH"] = python_path(self.directory, os.environ.get("PYTHONPATH"))
        for p in processes:
            message_file = Path(self._messages.name) / p.rpc_name
            own = gpu_env((visible or {}).get(p.rank)) | {TERMINATION_LOG: str(message_file)}
            env = os.environ | p.env | extra | own
            popen = subprocess.Popen(
                [sys.executable, *TRAINER_MODULE],
                # the malloc before it starts: the dynamic linker reads LD_PRELOAD only then
                env=env | tuning_levers.preload_env(env),
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                # Its own process group (to stop it with its children) but not its own session:
                # with autogroup scheduling a session per process slows training 2-10x.
                process_group=0,
            )
            pump = threading.Thread(
                target=self._pump, args=(popen.stdout, p.rpc_name.ljust(width)), daemon=True
            )
            pump.start()
            self.members.append(Running(p, popen, pump, message_file))
            self.say(f"started {p.rpc_name} (rank {p.rank}, pid {popen.pid})")

    def master_checked(self, monitor_port: int) -> bool:
        """Wait until the master, started alone, has checked what it can by itself (its
        /progress phase left `starting`: master_first.checked). False where it failed first:
        its refusal is the run's, and nothing else starts."""
        url = f"http://{LOOPBACK}:{monitor_port}/progress"
        master = self.members[0].popen
        while (code := master.poll()) is None:
            if master_first.checked(_phase(url)):
                return True
            time.sleep(POLL_SECONDS)
        return code == 0  # a trainer that ends before it checks (a stand-in): as planned

    def stop(self, grace: float) -> None:
        """SIGTERM every process group still alive, SIGKILL after `grace` seconds."""
        alive = [m for m in self.members if m.popen.poll() is None]
        for m in alive:
            _signal_group(m.popen, signal.SIGTERM)
            _signal_group(m.popen, signal.SIGCONT)  # a frozen (stopped) process, too
        deadline = time.monotonic() + grace
        for m in alive:
            try:
                m.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(m.popen, signal.SIGKILL)
                m.popen.wait()
        for m in self.members:
            _signal_group(m.popen, signal.SIGKILL)  # stray children of exited processes
            m.pump.join(timeout=2)
        self._messages.cleanup()

    def watch(self, grace: float) -> int:
        """Wait for the master to finish or any member to fail; return the job's exit code."""
        master = self.members[0]
        while True:
            for m in self.members:
                code = m.popen.poll()
                if code is None or (code == 0 and m is not master):
                    continue  # others may exit 0 while the world shuts down
                if m is master and code == 0:
                    return self._finish(grace)
                m, code = self._cause(m, code)
                p = m.process
                self.say(f"{m.name} (role {p.role}, rank {p.rank}) failed: {m.ending(code)}")
                if len(self.members) > 1:  # a master refusing alone started no other
                    self.say("stopping the other processes")
                self.stop(grace)
                return code if m is master and code > 0 else 1
            time.sleep(POLL_SECONDS)

    def _cause(self, first: Running, code: int) -> tuple[Running, int]:
        """The failure to name: `first`, unless it only lost a peer (BROKEN_PREFIX) and
        another process ends within SETTLE_SECONDS saying something else."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while (
            first.termination_message(code).startswith(BROKEN_PREFIX)
            and time.monotonic() < deadline
        ):
            for m in self.members:
                other = m.popen.poll()
                if other not in (None, 0) and not m.termination_message(other).startswith(
                    BROKEN_PREFIX
                ):
                    return m, other
            time.sleep(POLL_SECONDS)
        return first, code

    def _finish(self, grace: float) -> int:
        # Workers leave rpc.shutdown() right after the master: give them `grace` to do so.
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(m.popen.poll() is None for m in self.members):
            time.sleep(POLL_SECONDS)
        lingering = [m.name for m in self.members if m.popen.poll() is None]
        if lingering:
            self.say(f"stopping processes still running after the master: {', '.join(lingering)}")
        self.stop(grace)
        return 0


# Straight to loopback: a proxy in the caller's environment has no route to the master.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _phase(url: str) -> str | None:
    """The master's phase in its /progress report, or None while it does not answer."""
    try:
        with _opener.open(url, timeout=1) as reply:
            return Progress.parse(json.load(reply)).phase
    except (OSError, ValueError, AttributeError):
        return None


def _signal_group(popen: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def python_path(directory: Path, current: str | None) -> str:
    """PYTHONPATH with `directory` first and the caller's entries after it."""
    return os.pathsep.join([str(directory), *([current] if current else [])])


def gpu_env(visible: str | None) -> dict[str, str]:
    return {} if visible is None else {gpus.VISIBLE: visible}


def run_job(
    job: Job,
    grace: float = 10.0,
    out: TextIO | None = None,
    directory: Path | None = None,
    detect_gpus: Callable[[], list[str]] = gpus.detect,
) -> int:
    """Run `job` locally; return the master's exit code (non-zero if any member failed),
    or 2 when PIPEJOB_TUNING is wrong or this machine's GPUs (`detect_gpus`) cannot run it.
    Output goes to `out` (sys.stdout as it is at the call). With `directory` (`pipejob run`
    gives the manifest's folder), the processes run in it and import from it first: the user's
    code beside the manifest imports, and the manifest's relative paths (data, output,
    checkpoint) mean the same from any shell."""
    try:
        # each process would refuse it: say it once, first
        tuning_levers.parse(os.environ.get(TUNING))
    except ValueError as e:
        print(f"pipejob: cannot run {job.kind} {job.name!r}: {e}", file=out or sys.stdout)
        return 2
    try:
        processes, ports, placement, notes = placed(job, detect_gpus)
    except gpus.NotEnoughGPUs as e:
        print(f"pipejob: cannot run {job.kind} {job.name!r} here: {e}", file=out or sys.stdout)
        return 2
    world = World(out or sys.stdout, Path(directory).resolve() if directory is not None else None)
    for note in notes:
        world.say(note)
    world.say(
        f"running {job.kind} {job.name!r} as {len(processes)} local processes"
        f" ({', '.join(p.rpc_name for p in processes)}); rendezvous {LOOPBACK}:{ports.rpc},"
        f" progress http://{LOOPBACK}:{ports.monitor}/progress"
    )
    # Stop the world on Ctrl-C or SIGTERM, too: nothing may outlive the runner.
    previous = signal.signal(signal.SIGTERM, lambda *_: _raise_interrupt())
    try:
        start(world, job, processes, ports, placement.visible)
        code = world.watch(grace)
    except KeyboardInterrupt:
        world.say("interrupted; stopping every process")
        world.stop(grace)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    world.say(f"{job.kind} {job.name!r} " + ("succeeded" if code == 0 else "failed"))
    return code


def start(
    world: World, job: Job, processes: list[Process], ports: Ports, visible: dict[int, str]
) -> None:
    """Start the job's processes: where its master checks what it can alone before the world
    forms (Kind.checks_first: a PipelineJob's model against its data and loss), the master
    first and the others once it has, so that its refusal comes before any other starts."""
    if not job.definition.checks_first:
        world.start(processes, visible)
        return
    width = max(len(p.rpc_name) for p in processes)
    first = master_first.told(processes, master_first.PROCESSES)
    world.start(first[:1], visible, width)
    if world.master_checked(ports.monitor):
        world.start(first[1:], visible, width)


def placed(
    job: Job, detect_gpus: Callable[[], list[str]]
) -> tuple[list[Process], Ports, gpus.GpuPlacement, list[str]]:
    """The job's processes on loopback, their ports and GPUs, and what to say of them; where
    its NCCL group members would share GPUs, the spec its kind runs instead
    (Kind.on_shared_gpus), and why. NotEnoughGPUs where neither fits this machine's GPUs."""
    found = detect_gpus() if any(gpus_for(job, m) for m in members(job)) else []
    notes = []
    try:
        processes, ports, placement = _placed(job, found)
    except gpus.NotEnoughGPUs:
        instead = job.definition.on_shared_gpus(job.spec)
        if instead is None:
            raise
        spec, why = instead
        processes, ports, placement = _placed(dataclasses.replace(job, spec=spec), found)
        notes.append(why)
    return processes, ports, placement, notes + ([placement.note] if placement.note else [])


def _placed(job: Job, found: list[str]) -> tuple[list[Process], Ports, gpus.GpuPlacement]:
    # Every process shares one address here: each collective group needs a port of its own.
    free = free_ports(4 + len(groups(job, members(job))))
    ports = Ports(*free[:4], groups=tuple(free[4:]))
    processes = plan_world(job, lambda m: LOOPBACK, ports)
    return processes, ports, gpus.place(processes, found)


def _raise_interrupt() -> None:
    raise KeyboardInterrupt
