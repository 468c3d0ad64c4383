"""Hangs found within a bound and named (issue 19): the watchdog's heartbeats, its verdicts,
and real worlds of `pipejob run` with one member frozen (SIGSTOP) or killed (SIGKILL) in a
chosen phase. Each fault test prints the seconds from the fault to the runner's verdict."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from harness.standin import StandInMaster
from harness.variants import exhaustive
from jobrun import JobRun, assert_fits, pipeline_job
from pipejob.core import contract as c
from pipejob.core.common_spec import Watchdog
from pipejob.core.plan import plan_world
from pipejob.core.spec import parse
from pipejob.runner.local import free_ports
from pipejob.trainer.runtime import monitor, rpc_ledger, watchdog
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
    assert_fits(reply, watchdog.HeartbeatReply)  # what the member reads, as JSON
    members.heartbeat({"member": "stage0", "pid": 8})
    members.heartbeat({"member": "nobody", "pid": 9})  # not of this world: ignored
    assert set(members.seen) == {"stage0", "stage1"}
    now = time.monotonic()
    assert members.silent(now + 4) is None
    members.seen["stage0"] = replace(members.seen["stage0"], at=now + 10)  # stage0 beat later
    verdict = members.silent(now + 6.4)
    assert verdict == (
        "stage1 (pod w-stage-1) stopped answering: no heartbeat for 6 s, last"
        " seen in training at step 34"
    )


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
    server = monitor.BoardServer(board, 0, host="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.port}{c.HEARTBEAT_PATH}"
        reply = watchdog._post(url, b'{"member": "stage0", "pid": 42}', timeout=5)
        assert reply["phase"] == "starting" and reply["seconds"] == 5.0
        assert members.seen["stage0"].pid == 42
        with pytest.raises(OSError):  # not JSON: refused, and the member counts as unheard
            watchdog._post(url, b"{not json", timeout=5)
    finally:
        server.close()


def test_a_reply_cut_short_by_a_master_dying_counts_as_unanswered():
    """A master that dies mid-reply leaves its body short: an OSError like any lost
    heartbeat, never a traceback in the member's watchdog thread."""
    master = StandInMaster(path=c.HEARTBEAT_PATH)
    master.reply, master.cut_short = (200, b"{"), True
    try:
        with pytest.raises(ConnectionError, match="cut short"):
            watchdog._post(master.url, b"{}", timeout=5)
    finally:
        master.close()


def test_the_master_names_whom_it_waits_on_once_no_call_ended_for_longer_than_the_bound():
    """Every member still beats, but the call the master waits on never ends: the world is
    stuck, and the oldest outstanding call says on whom."""
    board = monitor.Board(10)
    master = env_of(pipeline_job("w", stages=2), 0, watchdog=Watchdog(seconds=5))
    ledger = rpc_ledger.Ledger()
    members = watchdog.Members(master, board, ledger)
    board.preflight(True, "passed")
    board.phase("training")
    board.step(34, loss=1.0, seconds=0.1, samples=8)
    members.heartbeat({"member": "stage0", "pid": 8, "ended": 40})
    members.heartbeat({"member": "stage1", "pod": "w-stage-1", "pid": 9, "ended": 40})

    def beating(at: float) -> float:  # both members beat, their served counts unchanged
        for name in ("stage0", "stage1"):
            members.seen[name] = replace(members.seen[name], at=at)
        return at

    start = time.monotonic()
    members.silent(start)  # the world formed
    assert members.stuck(start) is None  # the first look: progress as it is now
    assert members.stuck(beating(start + 6)) is None  # waiting on nobody: not judged
    ledger.begin(("stage1",), "on_stage forward")
    ledger.begin(("stage0",), "on_stage settle")
    # The clock runs from the last look at a master waiting on nobody.
    assert members.stuck(beating(start + 7)) is None
    assert members.stuck(beating(start + 11)) is None  # within the bound
    assert members.stuck(beating(start + 12.4)) == (
        "no progress for 6 s in training at step 34: waiting on stage1 (pod w-stage-1) for"
        " on_stage forward (called 12 s ago); also on stage0 (pid 8)"
    )
    # The call went on from stage1, whose heartbeats say so: the verdict follows it.
    waits = [["stage0"], "passed_on", 11.6]
    members.heartbeat(
        {"member": "stage1", "pod": "w-stage-1", "pid": 9, "ended": 40, "waits": waits}
    )
    assert members.stuck(beating(start + 12.5)) == (
        "no progress for 6 s in training at step 34: waiting on stage1 (pod w-stage-1) for"
        " on_stage forward (called 12 s ago), which waits on stage0 (pid 8) for passed_on"
        " (12 s); also on stage0 (pid 8)"
    )
    members.heartbeat({"member": "stage0", "pid": 8, "ended": 41})  # stage0 served a call
    assert members.stuck(beating(start + 13)) is None  # progress: the clock starts again
    members.seen["stage0"] = replace(members.seen["stage0"], at=start + 13)
    # stage0 falls silent: `silent` names it as not answering once the bound has passed.
    assert members.stuck(start + 19) is None


def test_a_master_that_takes_heartbeats_without_answering_is_told_from_one_not_started():
    """A frozen master's monitor still accepts connections (the kernel does), so a heartbeat
    times out; a master not started yet refuses them. Only the first counts as silence for
    a member that never heard the master."""
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()  # accepts, never answers: frozen
    closed = free_ports(1)[0]  # nothing listens: not started
    try:
        for port, frozen in ((listening.getsockname()[1], True), (closed, False)):
            with pytest.raises(OSError) as e:
                watchdog._post(f"http://127.0.0.1:{port}{c.HEARTBEAT_PATH}", b"{}", timeout=1)
            assert watchdog._timed_out(e.value) is frozen, e.value
    finally:
        listening.close()


def test_the_calls_a_master_makes_and_serves_are_counted_and_the_open_ones_kept(tmp_path):
    """Over a real RPC agent (a world of one, calling itself): each call made and each
    served counts once when it ends; one that has not ended is outstanding."""
    script = tmp_path / "calls.py"
    script.write_text(CALLS_WORLD)
    port = free_ports(1)[0]
    done = subprocess.run(
        [sys.executable, str(script), str(port)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["open:master:sleep", "ended:8"], done.stdout


CALLS_WORLD = """
import operator, sys, time
import torch.distributed.rpc as rpc
from pipejob.trainer.runtime import rpc_ledger, failures

failures.say_remote_errors_in_one_line()  # which counts the calls served
rpc_ledger.trace(["master"])
options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{sys.argv[1]}")
rpc.init_rpc("master", rank=0, world_size=1, rpc_backend_options=options)
assert rpc.rpc_sync("master", operator.add, args=(1, 2)) == 3
assert rpc.rpc_async("master", operator.add, args=(2, 2)).wait() == 4
assert rpc.remote("master", operator.add, args=(3, 2)).to_here() == 5
sleeping = rpc.rpc_async("master", time.sleep, args=(3,))
time.sleep(1)
print(" ".join(f"open:{','.join(c.to)}:{c.what}" for c in rpc_ledger.LEDGER.outstanding()))
sleeping.wait()
time.sleep(0.5)
print(f"ended:{rpc_ledger.LEDGER.ended()}")
rpc.shutdown()
"""


@pytest.mark.parametrize(
    ("error", "lost"),
    [
        (
            RuntimeError(
                "ECONNRESET: connection reset by peer (this error originated at"
                " tensorpipe/transport/uv/connection_impl.cc:132)"
            ),
            True,
        ),
        (RuntimeError("EOF: end of file (this error originated at tensorpipe)"), True),
        (
            RuntimeError(
                "eof (this error originated at tensorpipe/transport/shm/connection_impl.cc:259)"
            ),
            True,
        ),
        (
            RuntimeError(
                "RPC ran for more than set timeout (300000 ms) and will now be marked with an error"
            ),
            True,
        ),
        (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"), True),
        (
            RuntimeError(
                "Error on Node 2: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out"
                " waiting 59999ms for recv operation to complete"
            ),
            True,
        ),
        (ConnectionRefusedError(111, "Connection refused"), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (KeyError("layer4"), False),
    ],
)
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


WATCHED_HYBRID = {
    "apiVersion": "pipejob.dev/v1alpha1",
    "kind": "HybridJob",
    "metadata": {"name": "wdh"},
    "spec": {
        "trainers": 2,
        "steps": 100000,
        "batchSize": 8,
        "datasetSize": 256,
        "rendezvousTimeoutSeconds": 60,
        "watchdog": {"seconds": BOUND},
        "preflight": {"megabytes": 0.25},
    },
}
FAULTS = {
    # (manifest, member, signal, the line after which the fault strikes, what the runner says)
    "frozen stage in training": (  # on the rpc engine; the pipelining engine's below
        pipeline_job(
            "wd",
            engine="rpc",
            stages=2,
            microBatches=2,
            batchSize=4,
            steps=100000,
            watchdog={"seconds": BOUND},
        ),
        "stage1",
        signal.SIGSTOP,
        r"^master\s*\|.*step 3/",
        r"master \(role master, rank 0\) failed: exit code 6: stalled: stage1 \(pid {pid}\)"
        r" stopped answering: no heartbeat for \d+ s, last seen in \w+ at step \d+",
    ),
    "frozen stage in training on the pipelining engine": (
        pipeline_job(
            "wd",
            engine="pipelining",
            stages=2,
            microBatches=2,
            batchSize=4,
            steps=100000,
            watchdog={"seconds": BOUND},
        ),
        "stage0",
        signal.SIGSTOP,
        r"^master\s*\|.*step 3/",
        r"master \(role master, rank 0\) failed: exit code 6: stalled: stage0 \(pid {pid}\)"
        r" stopped answering: no heartbeat for \d+ s, last seen in \w+ at step \d+",
    ),
    "frozen master in training": (
        pipeline_job(
            "wd", stages=2, microBatches=2, batchSize=4, steps=100000, watchdog={"seconds": BOUND}
        ),
        "master",
        signal.SIGSTOP,
        r"^master\s*\|.*step 3/",
        r"stage\d \(role stage, rank \d\) failed: exit code 6: stalled: master \(pid {pid}\)"
        r" stopped answering: no reply to heartbeats for \d+ s, last seen in \w+ at step \d+",
    ),
    "frozen stage while the master measures": (
        pipeline_job(
            "wd", stages=2, microBatches=2, batchSize=4, steps=100000, watchdog={"seconds": BOUND}
        ),
        "stage0",
        signal.SIGSTOP,
        r"^master\s*\|.*preflight: passed",
        # Last heard before the master's preflight began (starting), or frozen before its
        # first heartbeat reached the master (named without its pid).
        r"stalled: stage0 (\(pid {pid}\) stopped answering: no heartbeat for \d+ s, last seen"
        r" in (starting|preflight|training) at step 0|stopped answering: no heartbeat at all"
        r" for \d+ s since the world formed)",
    ),
    "frozen parameter server in training": (
        WATCHED_HYBRID,
        "ps0",
        signal.SIGSTOP,
        r"^master\s*\|.*step \d+/",
        r"stalled: ps0 \(pid {pid}\) stopped answering: no heartbeat for \d+ s, last seen in"
        r" \w+ at step \d+",
    ),
    "frozen trainer in training": (
        WATCHED_HYBRID,
        "trainer1",
        signal.SIGSTOP,
        r"^master\s*\|.*step \d+/",
        r"stalled: trainer1 \(pid {pid}\) stopped answering: no heartbeat for \d+ s, last seen"
        r" in \w+ at step \d+",
    ),
    "killed trainer in training": (
        WATCHED_HYBRID,
        "trainer1",
        signal.SIGKILL,
        r"^master\s*\|.*step \d+/",
        r"trainer1 \(role trainer, rank \d\) failed: killed by signal SIGKILL",
    ),
}


@pytest.mark.timeout(240)
def struck_run_ends(
    manifest: dict, member: str, sig: int, after: str, verdict: str, tmp_path, wait: float = 60
) -> tuple[re.Match, float]:
    """Strike `member` with `sig` once the run says `after`: the run fails with `verdict` (a
    pattern, `{pid}` the struck process's), in lines. The verdict, and the seconds from the
    fault to it."""
    with JobRun(manifest, tmp_path) as run:
        run.wait_for(after, timeout=180)
        pid = run.pid(member)
        os.kill(pid, sig)
        struck = time.monotonic()
        said = run.wait_for(verdict.format(pid=pid), timeout=wait)
        reacted = time.monotonic() - struck
        code = run.finish(timeout=60)
    assert code != 0
    _quiet(run.output)
    return said, reacted


# `make test` proves each verdict once: a frozen stage and master here, a killed member in
# test_faults_by_phase.py; `make test-all` every role in every phase (tests/README.md).
@pytest.mark.parametrize(
    "fault",
    exhaustive(
        FAULTS,
        {
            "frozen stage in training",
            "frozen master in training",
        },
    ),
)
def test_a_fault_ends_the_local_run_naming_the_member_in_lines(fault, tmp_path):
    manifest, member, sig, after, verdict = FAULTS[fault]
    _, reacted = struck_run_ends(manifest, member, sig, after, verdict, tmp_path)
    print(
        f"{fault}: {signal.Signals(sig).name} of {member}, verdict after {reacted:.1f} s"
        f" (bound {BOUND} s)"
    )


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


# ------------------------------------------- a world that stops while every member beats

TESTS = Path(__file__).parent  # holds userpkg/, brought by `import:` as a user's package


def stuck_pipeline(trigger: Path) -> dict:
    model = {"import": "userpkg.stuck:cnn", "args": {"trigger": str(trigger)}}
    return pipeline_job(
        "wp",
        engine="rpc",  # the verdict names the rpc engine's calls (forward_round, passed_on)
        stages=2,
        microBatches=2,
        batchSize=4,
        steps=100000,
        watchdog={"seconds": BOUND},
        model=model,
    )


def stuck_hybrid(trigger: Path, rank: int) -> dict:
    dense = {"trigger": str(trigger), "rank": rank, "dim": 8, "hidden": 16, "classes": 4}
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": "wph"},
        "spec": {
            "trainers": 2,
            "steps": 100000,
            "batchSize": 8,
            "datasetSize": 256,
            "embedding": {"numEmbeddings": 64, "dim": 8, "mode": "sum"},
            "dense": {"outFeatures": 4, "import": "userpkg.stuck:dense", "args": dense},
            "rendezvousTimeoutSeconds": 60,
            "watchdog": {"seconds": BOUND},
            "preflight": {"megabytes": 0.25},
        },
    }


STUCK = {
    # (manifest of a trigger file, the member whose work gets stuck, what the runner says)
    "pipeline: a stage's forward": (
        stuck_pipeline,
        "stage1",
        r"master \(role master, rank 0\) failed: exit code 6: stalled: no progress for \d+ s in"
        r" training at step \d+: waiting on stage0 \(pid \d+\) for on_stage forward_round"
        r" \(called \d+ s ago\), which waits on stage1 \(pid {pid}\) for passed_on",
    ),
    "hybrid: a trainer's dense forward": (
        lambda trigger: stuck_hybrid(trigger, rank=3),
        "trainer1",
        r"master \(role master, rank 0\) failed: exit code 6: stalled: no progress for \d+ s in"
        r" training at step \d+: waiting on trainer\d \(pid \d+\) for train .*trainer1 \(pid"
        r" {pid}\)",
    ),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", exhaustive(STUCK, {"pipeline: a stage's forward"}))
def test_a_world_whose_work_is_stuck_while_it_beats_ends_naming_whom_it_waits_on(
    case, tmp_path, monkeypatch
):
    make, member, verdict = STUCK[case]
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    )
    trigger = tmp_path / "stuck"
    with JobRun(make(trigger), tmp_path) as run:
        run.wait_for(r"^master\s*\|.*step \d+/", timeout=180)
        trigger.touch()  # from now on, the member's next forward never returns
        struck = time.monotonic()
        pid = run.pid(member)
        said = run.wait_for(verdict.format(pid=pid), timeout=90)
        reacted = time.monotonic() - struck
        code = run.finish(timeout=60)
    assert code == c.ExitCode.STALLED
    _quiet(run.output)
    print(
        f"{case}: stuck work on {member}, verdict after {reacted:.1f} s (bound {BOUND} s):"
        f" {said.string}"
    )
