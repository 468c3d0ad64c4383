"""Hangs found within a bound and named (issue 19): the watchdog's heartbeats, its verdicts,
and real worlds of `pipejob run` with one member frozen (SIGSTOP) or killed (SIGKILL) in a
chosen phase. Each fault test prints the seconds from the fault to the runner's verdict."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import replace

import pytest

from jobrun import JobRun, pipeline_job
from pipejob.core import contract as c
from pipejob.core.common import Watchdog
from pipejob.core.plan import plan_world
from pipejob.core.spec import parse
from pipejob.trainer.runtime import monitor, watchdog
from pipejob.trainer.runtime.failures import lost_peer, one_line
from pipejob.trainer.runtime.world import read_env

# A few seconds keep the fault tests short; the default bound is documented (user guide).
BOUND = 10


def env_of(manifest: dict, rank: int, **spec):
    job = parse(manifest)
    process = plan_world(job, lambda m: "127.0.0.1")[rank]
    env = read_env(process.env)
    return replace(env, spec=replace(env.spec, **spec)) if spec else env


# --------------------------------------------------------------------- the verdicts, unit


def test_the_bound_is_the_specs_or_derived_from_the_slowest_step_within_limits():
    board = monitor.Board(10)
    master = env_of(pipeline_job("w", stages=2), 0)
    assert watchdog.bound(master, board) == c.WATCHDOG_FLOOR  # nothing measured yet
    board.step(1, loss=1.0, seconds=9.0, samples=8)
    assert watchdog.bound(master, board) == 90.0  # 10x the slowest step
    board.step(2, loss=1.0, seconds=1000.0, samples=8)
    assert watchdog.bound(master, board) == c.WATCHDOG_CAP
    chosen = env_of(pipeline_job("w", stages=2), 0, watchdog=Watchdog(seconds=7))
    assert watchdog.bound(chosen, board) == 7.0


def test_the_master_names_a_member_silent_for_longer_than_the_bound():
    board = monitor.Board(10)
    master = env_of(pipeline_job("w", stages=2), 0, watchdog=Watchdog(seconds=5))
    members = watchdog.Members(master, board)
    board.phase("training")
    board.step(34, loss=1.0, seconds=0.1, samples=8)
    reply = members.heartbeat({"member": "stage1", "pod": "w-stage-1", "pid": 7})
    assert reply["phase"] == "training" and reply["step"] == 34 and reply["seconds"] == 5.0
    members.heartbeat({"member": "stage0", "pid": 8})
    members.heartbeat({"member": "nobody", "pid": 9})  # not of this world: ignored
    assert set(members.seen) == {"stage0", "stage1"}
    now = time.monotonic()
    assert members.silent(now + 4) is None
    members.seen["stage0"] = replace(members.seen["stage0"], at=now + 10)  # stage0 beat later
    verdict = members.silent(now + 6.4)
    assert verdict == ("stage1 (pod w-stage-1) stopped answering: no heartbeat for 6 s, last"
                       " seen in training at step 34")  # fmt: skip


def test_a_member_never_heard_from_is_named_once_the_preflight_passed():
    """Every member checked in to the preflight with its heartbeats already started: one
    silent since is frozen, whatever the master is doing (e.g. measuring what parts cost)."""
    board = monitor.Board(10)
    master = env_of(pipeline_job("w", stages=2), 0, watchdog=Watchdog(seconds=5))
    members = watchdog.Members(master, board)
    members.heartbeat({"member": "stage1", "pid": 9})
    start = time.monotonic()
    assert members.silent(start + 1) is None  # before the preflight: the rendezvous waits
    board.preflight(True, "passed")
    assert members.silent(start + 2) is None  # the clock starts now
    members.seen["stage1"] = replace(members.seen["stage1"], at=start + 8)  # stage1 beats
    assert members.silent(start + 8) == (
        "stage0 stopped answering: no heartbeat at all for 6 s since the world formed"
    )


def test_a_member_never_heard_from_is_named_only_once_training_began():
    board = monitor.Board(10)
    master = env_of(pipeline_job("w", stages=2), 0, watchdog=Watchdog(seconds=5))
    members = watchdog.Members(master, board)
    members.heartbeat({"member": "stage0", "pid": 8})
    start = time.monotonic()
    assert members.silent(start + 1) is None  # the rendezvous waits for late members
    board.phase("training")
    members.heartbeat({"member": "stage0", "pid": 8})
    assert members.silent(time.monotonic()) is None
    later = time.monotonic() + 6
    members.seen["stage0"] = replace(members.seen["stage0"], at=later)  # stage0 still beats
    verdict = members.silent(later)
    assert verdict is not None and verdict.startswith("stage1 stopped answering: no heartbeat")


def test_heartbeats_travel_over_http_to_the_masters_monitor():
    board = monitor.Board(10)
    master = env_of(pipeline_job("w", stages=2), 0, watchdog=Watchdog(seconds=5))
    members = watchdog.Members(master, board)
    board.on_heartbeat = members.heartbeat
    server = monitor.Server(board, 0, host="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.port}{c.HEARTBEAT_PATH}"
        reply = watchdog._post(url, b'{"member": "stage0", "pid": 42}', timeout=5)
        assert reply["phase"] == "starting" and reply["seconds"] == 5.0
        assert members.seen["stage0"].pid == 42
        with pytest.raises(OSError):  # not JSON: refused, and the member counts as unheard
            watchdog._post(url, b"{not json", timeout=5)
    finally:
        server.close()


@pytest.mark.parametrize(
    ("error", "lost"),
    [
        (RuntimeError("ECONNRESET: connection reset by peer (this error originated at"
                      " tensorpipe/transport/uv/connection_impl.cc:132)"), True),
        (RuntimeError("EOF: end of file (this error originated at tensorpipe)"), True),
        (RuntimeError("RPC ran for more than set timeout (300000 ms) and will now be marked"
                      " with an error"), True),
        (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"), True),
        (ConnectionRefusedError(111, "Connection refused"), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (KeyError("layer4"), False),
    ],
)  # fmt: skip
def test_a_lost_peer_is_told_from_a_bug(error, lost):
    assert lost_peer(error) is lost


def test_one_line_says_the_error_and_where():
    try:
        raise ValueError("bad size\n  of 3")
    except ValueError as e:
        line = one_line(e)
    assert line.startswith("ValueError: bad size of 3 (at test_watchdog.py:")
    assert "\n" not in line and "in test_one_line_says_the_error_and_where)" in line


# ------------------------------------------------------------- real worlds, one fault each


def _quiet(output: str) -> None:
    """An expected failure is said in lines, never in tracebacks or TensorPipe's warnings."""
    assert "Traceback" not in output, output
    assert "tensorpipe_agent" not in output and not re.search(r"\[W\d{4} ", output), output


FAULTS = {
    # (manifest, member, signal, the line after which the fault strikes, what the runner says)
    "frozen stage in training": (
        pipeline_job("wd", stages=2, microBatches=2, batchSize=4, steps=100000,
                     watchdog={"seconds": BOUND}),
        "stage1", signal.SIGSTOP, r"^master\s*\|.*step 3/",
        r"master \(role master, rank 0\) failed: exit code 6: stalled: stage1 \(pid {pid}\)"
        r" stopped answering: no heartbeat for \d+ s, last seen in \w+ at step \d+",
    ),
    "frozen master in training": (
        pipeline_job("wd", stages=2, microBatches=2, batchSize=4, steps=100000,
                     watchdog={"seconds": BOUND}),
        "master", signal.SIGSTOP, r"^master\s*\|.*step 3/",
        r"stage\d \(role stage, rank \d\) failed: exit code 6: stalled: master \(pid {pid}\)"
        r" stopped answering: no reply to heartbeats for \d+ s, last seen in \w+ at step \d+",
    ),
    "frozen stage while the master measures": (
        pipeline_job("wd", stages=2, microBatches=2, batchSize=4, steps=100000,
                     watchdog={"seconds": BOUND}),
        "stage0", signal.SIGSTOP, r"^master\s*\|.*preflight: passed",
        # Last heard before the master's preflight began (starting), or frozen before its
        # first heartbeat reached the master (named without its pid).
        r"stalled: stage0 (\(pid {pid}\) stopped answering: no heartbeat for \d+ s, last seen"
        r" in (starting|preflight|training) at step 0|stopped answering: no heartbeat at all"
        r" for \d+ s since the world formed)",
    ),
    "frozen parameter server in training": (
        {"apiVersion": "pipejob.dev/v1alpha1", "kind": "HybridJob", "metadata": {"name": "wdh"},
         "spec": {"trainers": 2, "steps": 100000, "batchSize": 8, "datasetSize": 256,
                  "rendezvousTimeoutSeconds": 60, "watchdog": {"seconds": BOUND},
                  "preflight": {"megabytes": 0.25}}},
        "ps", signal.SIGSTOP, r"^master\s*\|.*step \d+/",
        r"stalled: ps \(pid {pid}\) stopped answering: no heartbeat for \d+ s, last seen in"
        r" \w+ at step \d+",
    ),
    "killed trainer in training": (
        {"apiVersion": "pipejob.dev/v1alpha1", "kind": "HybridJob", "metadata": {"name": "wdh"},
         "spec": {"trainers": 2, "steps": 100000, "batchSize": 8, "datasetSize": 256,
                  "rendezvousTimeoutSeconds": 60, "watchdog": {"seconds": BOUND},
                  "preflight": {"megabytes": 0.25}}},
        "trainer1", signal.SIGKILL, r"^master\s*\|.*step \d+/",
        r"trainer1 \(role trainer, rank \d\) failed: killed by signal SIGKILL",
    ),
}  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_ends_the_local_run_naming_the_member_in_lines(fault, tmp_path):
    manifest, member, sig, after, verdict = FAULTS[fault]
    with JobRun(manifest, tmp_path) as run:
        run.wait_for(after, timeout=180)
        pid = run.pid(member)
        os.kill(pid, sig)
        struck = time.monotonic()
        run.wait_for(verdict.format(pid=pid), timeout=60)
        reacted = time.monotonic() - struck
        code = run.finish(timeout=60)
    assert code != 0
    _quiet(run.output)
    print(f"{fault}: {signal.Signals(sig).name} of {member}, verdict after {reacted:.1f} s"
          f" (bound {BOUND} s)")  # fmt: skip


def test_the_watchdog_thread_leaves_with_the_world():
    """The master's watch ends when the world is over (no verdict after the end)."""
    board = monitor.Board(10)
    master = env_of(pipeline_job("w", stages=2), 0, watchdog=Watchdog(seconds=2))
    members = watchdog.Members(master, board)
    board.phase("finished")
    thread = threading.Thread(target=members.watch, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
