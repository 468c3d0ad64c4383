"""Per-process performance settings: the pure decisions, and applying them before torch loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from pipejob.core import contract as c
from pipejob.core import tuning_levers
from pipejob.trainer.runtime import tuning
from pipejob.trainer.runtime.tuning import ProcessTuning, decide

pytestmark = pytest.mark.timeout(60)

ALL = tuning_levers.parse(None)
PIPELINE_WORLD = ["master", "stage", "stage"]  # roles in rank order


def test_levers_from_the_environment_variable():
    assert ALL == {"threads": "", "allocator": "", "transport": ""}
    assert tuning_levers.parse("on") == ALL
    assert tuning_levers.parse(" ") == ALL
    assert tuning_levers.parse("off") == {}
    assert tuning_levers.parse("threads, transport") == {"threads": "", "transport": ""}
    assert tuning_levers.parse("threads,allocator = tcmalloc") == {
        "threads": "",
        "allocator": "tcmalloc",
    }


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("threads,turbo", r"PIPEJOB_TUNING='threads,turbo': unknown lever\(s\) turbo"),
        ("allocator=mimalloc", r"allocator=mimalloc: choose one of tcmalloc, jemalloc, glibc"),
        ("threads=2", r"threads=2: threads takes no choice"),
    ],
)
def test_an_unknown_lever_or_choice_is_refused_naming_the_variable(value, says):
    with pytest.raises(ValueError, match=says):
        tuning_levers.parse(value)


def test_pipejob_run_refuses_an_unknown_choice_before_anything_starts(monkeypatch):
    import io

    import pipejob.runner.local as local
    from jobrun import pipeline_job
    from pipejob.core import spec

    monkeypatch.setenv(tuning_levers.TUNING, "allocator=mimalloc")
    monkeypatch.setattr(local.World, "start", lambda *a: pytest.fail("a process started"))
    out = io.StringIO()
    assert local.run_job(spec.parse(pipeline_job("bad", stages=2)), out=out) == 2
    assert out.getvalue() == (
        "pipejob: cannot run PipelineJob 'bad': PIPEJOB_TUNING='allocator=mimalloc':"
        " allocator=mimalloc: choose one of tcmalloc, jemalloc, glibc\n"
    )


def test_the_allocator_lever_asks_for_tcmalloc_unless_told_otherwise():
    assert tuning_levers.wanted_malloc({}).name == "tcmalloc"
    assert (
        tuning_levers.wanted_malloc({tuning_levers.TUNING: "allocator=jemalloc"}).name == "jemalloc"
    )
    assert (
        tuning_levers.wanted_malloc({tuning_levers.TUNING: "threads,allocator=glibc"}).name
        == "glibc"
    )
    assert tuning_levers.wanted_malloc({tuning_levers.TUNING: "threads,transport"}) is None
    assert tuning_levers.wanted_malloc({tuning_levers.TUNING: "off"}) is None


def test_preload_names_the_wanted_library_unless_a_malloc_is_preloaded_already(monkeypatch):
    """The env a process must start with (the host's libraries are the boundary: `find`)."""
    found = {"jemalloc": "libjemalloc.so.2", "tcmalloc_minimal": "libtcmalloc_minimal.so.4"}
    monkeypatch.setattr(tuning_levers, "library_file", found.get)
    tcmalloc = {"LD_PRELOAD": "libtcmalloc_minimal.so.4"}
    assert tuning_levers.preload_env({}) == tcmalloc
    theirs = {"LD_PRELOAD": "libfaketime.so.1", tuning_levers.TUNING: "allocator=jemalloc"}
    assert tuning_levers.preload_env(theirs) == {"LD_PRELOAD": "libjemalloc.so.2 libfaketime.so.1"}
    # theirs wins
    assert tuning_levers.preload_env({"LD_PRELOAD": "/opt/lib/libmimalloc.so.2"}) == {}
    # started with it: nothing more (no second start)
    assert tuning_levers.preload_env(tcmalloc) == {}
    assert tuning_levers.preload_env({tuning_levers.TUNING: "threads,transport"}) == {}
    assert tuning_levers.preload_env({tuning_levers.TUNING: "allocator=glibc"}) == {}
    monkeypatch.setattr(tuning_levers, "library_file", lambda library: None)
    assert tuning_levers.preload_env({}) == {}  # not on this host: glibc, and the process says why


MAPS = """\
55d0c2a00000-55d0c2a2c000 r--p 00000000 08:01 1835 /usr/bin/python3.11
7f0e1c000000-7f0e1c021000 rw-p 00000000 00:00 0
7f0e1d2f6000-7f0e1d31c000 r--p 00000000 08:01 4242 /usr/lib/x86_64-linux-gnu/{}
7ffd5e1d0000-7ffd5e1f1000 rw-p 00000000 00:00 0                          [stack]
"""


def test_the_malloc_a_process_runs_with_is_read_from_its_loaded_libraries():
    assert tuning.running_malloc(MAPS.format("libjemalloc.so.2")) == (
        "jemalloc",
        "libjemalloc.so.2",
    )
    tcmalloc = "libtcmalloc_minimal.so.4.5.10"
    assert tuning.running_malloc(MAPS.format(tcmalloc)) == ("tcmalloc", tcmalloc)
    assert tuning.running_malloc(MAPS.format("libmimalloc.so.2.0")) == (
        "mimalloc",
        "libmimalloc.so.2.0",
    )
    assert tuning.running_malloc(MAPS.format("libc.so.6")) == ("glibc", "")
    tcmalloc = tuning_levers.MALLOCS["tcmalloc"]
    said = "tcmalloc is not installed here (Debian's libtcmalloc-minimal4)"
    assert tuning.missing("", tcmalloc) == said
    assert tuning.missing("libjemalloc.so.2", tcmalloc) == ""  # the user's preload
    assert tuning.missing("", tuning_levers.MALLOCS["glibc"]) == tuning.missing("", None) == ""


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("max 100000", None), ("200000 100000", 2.0), ("150000 100000\n", 1.5), ("", None)],
)
def test_cgroup_quota(text, cpus):
    assert tuning.cgroup_cpus(text) == cpus


def test_loopback_addresses_are_one_host():
    assert tuning.same_host("127.0.0.1", "127.0.0.1")
    assert tuning.same_host("127.0.0.2", "127.0.0.3")  # the process-kubelet's pods
    assert tuning.same_host("localhost", "127.0.0.1")
    assert not tuning.same_host("job-stage-0.job", "job-stage-1.job")
    assert tuning.same_host("job-stage-0.job", "job-stage-0.job")


def test_colocated_compute_counts_the_compute_roles_on_this_host():
    local = ["127.0.0.1"] * 3
    assert tuning.colocated_compute("PipelineJob", PIPELINE_WORLD, local, 1) == 2
    assert tuning.colocated_compute("PipelineJob", PIPELINE_WORLD, local, 0) == 2  # master too
    pods = ["j-master-0.j", "j-stage-0.j", "j-stage-1.j"]
    assert tuning.colocated_compute("PipelineJob", PIPELINE_WORLD, pods, 1) == 1
    assert tuning.colocated_compute("PipelineJob", PIPELINE_WORLD, pods, 0) == 0
    hybrid = ["master", "ps", "trainer", "trainer"]
    assert tuning.colocated_compute("HybridJob", hybrid, ["127.0.0.1"] * 4, 2) == 3
    # Without addresses every process is on its own host.
    assert tuning.colocated_compute("PipelineJob", PIPELINE_WORLD, [], 2) == 1
    assert tuning.colocated_compute("PipelineJob", PIPELINE_WORLD, [], 0) == 0


def test_a_trainer_that_runs_a_server_counts_as_two_compute_roles():
    """spec.serversInTrainers: 2 trainers each running a server share a host's cores as the
    4 processes of 2 x 2 do (1 intra-op thread each on 2 cores, not 2: measured, user guide)."""
    inside = {"serversInTrainers": True}
    world, local = ["master", "trainer", "trainer"], ["127.0.0.1"] * 3
    assert tuning.compute_roles("HybridJob", "trainer", inside) == 2
    assert tuning.compute_roles("HybridJob", "trainer", {}) == 1
    assert tuning.compute_roles("HybridJob", "master", inside) == 0
    assert tuning.colocated_compute("HybridJob", world, local, 1, inside) == 4
    assert tuning.colocated_compute("HybridJob", world, [], 1, inside) == 2  # a pod of its own
    assert decide("HybridJob", "trainer", 0, 2, 4, ALL).threads == 1


def test_compute_roles_oversubscribe_only_a_share_under_two_cores():
    # A pipeline's stages with a core or less each: one thread (more per CPU-second).
    assert decide("PipelineJob", "stage", 0, 2, 2, ALL).threads == 1
    assert decide("PipelineJob", "stage", 0, 4, 4, ALL).threads == 1
    assert decide("HybridJob", "trainer", 0, 2, 2, ALL).threads == 2  # its kind: doubled
    # Named engine rpc: doubled as before (it halves its speed on one thread).
    assert decide("PipelineJob", "stage", 0, 2, 2, ALL, spec={"engine": "rpc"}).threads == 2
    assert decide("PipelineJob", "stage", 0, 2, 2, ALL, spec={"engine": "auto"}).threads == 1
    assert decide("PipelineJob", "stage", 0, 16, 8, ALL).threads == 2  # a share of 2: its own
    assert decide("PipelineJob", "stage", 0, 16, 2, ALL).threads == 8
    assert decide("PipelineJob", "stage", 0, 3, 2, ALL).threads == 3  # 1.5 doubled
    assert decide("PipelineJob", "stage", 0, 2, 1, ALL).threads == 2  # never above the host
    assert decide("PipelineJob", "stage", 0, 2, 8, ALL).threads == 1  # never below one
    assert decide("PipelineJob", "stage", 0, 3.5, 1, ALL).threads == 3  # a fractional quota
    assert decide("HybridJob", "trainer", 0, 2, 3, ALL).threads == 1


def test_threads_follow_the_cpus_the_process_may_run_on():
    """A stage started on one CPU of this machine's (its affinity, as taskset or a cpuset
    gives it) derives its threads from that one, not from the machine's count."""
    code = (
        "from pipejob.trainer.runtime import tuning;"
        "print(tuning.available_cpus(), tuning.for_process('PipelineJob', 'stage', 1,"
        " ['master', 'stage', 'stage'], 0, {'PIPEJOB_ADDRESSES': '127.0.0.1,' * 3}).threads)"
    )
    mine = sorted(os.sched_getaffinity(0))
    threads = {}
    for cpus in ([mine[0]], mine):
        pin = lambda cpus=cpus: os.sched_setaffinity(0, cpus)  # noqa: E731  (as taskset)
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=50,
            check=True,
            preexec_fn=pin,
        )
        available, threads[len(cpus)] = out.stdout.split()
        assert float(available) <= len(cpus)  # a cgroup quota may bound it further
        # 2 stages share the CPUs: a core or less each, one thread; more, as decide says.
        expected = decide("PipelineJob", "stage", 0, float(available), 2, ALL).threads
        assert int(threads[len(cpus)]) == expected
    assert threads[1] == "1"


def test_the_engine_the_spec_names_reaches_the_thread_choice():
    """for_process reads spec.engine from the env contract: on a host of 2 cores or fewer, 2
    stages on the rpc engine keep the doubled share, on the pipelining engine one thread."""
    local = {c.ADDRESSES: ",".join(["127.0.0.1"] * 3)}
    cpus = tuning.available_cpus()
    for engine in ("rpc", "pipelining"):
        env = local | {c.SPEC: json.dumps({"engine": engine})}
        got = tuning.for_process("PipelineJob", "stage", 1, PIPELINE_WORLD, 0, env).threads
        spec = {"engine": engine}
        assert got == decide("PipelineJob", "stage", 0, cpus, 2, ALL, spec=spec).threads
        if cpus == 2:
            assert got == (2 if engine == "rpc" else 1)


def test_openmp_threads_sleep_while_waiting_only_on_shared_cores():
    assert decide("PipelineJob", "stage", 0, 2, 2, ALL).passive_wait
    assert decide("PipelineJob", "master", 0, 2, 2, ALL).passive_wait
    assert not decide("PipelineJob", "stage", 0, 8, 1, ALL).passive_wait  # a host of its own
    assert not decide("PipelineJob", "stage", 0, 2, 2, {"allocator"}).passive_wait


def test_a_light_role_leaves_shared_cores_to_the_compute_roles():
    assert decide("PipelineJob", "master", 0, 16, 2, ALL).threads == 1
    assert decide("PipelineJob", "master", 0, 16, 0, ALL).threads == 16  # a host of its own


def test_cpu_only_pipelines_avoid_the_shared_memory_transport():
    for role in ("master", "stage"):
        s = decide("PipelineJob", role, 0, 2, 2, ALL)
        assert (s.transports, s.channels) == (["uv"], ["basic"])
    gpu = decide("PipelineJob", "stage", 1, 2, 2, ALL)
    assert (gpu.transports, gpu.channels) == (None, None)  # torch's CUDA-aware defaults
    for role in ("trainer", "ps"):  # latency-bound: shm's polling helps, given spare cores
        hybrid = decide("HybridJob", role, 0, 16, 4, ALL)
        assert (hybrid.transports, hybrid.channels) == (None, None)
        for cpus, colocated in [(2, 4), (4, 3), (16, 1)]:  # too few cores; no peer on the host
            hybrid = decide("HybridJob", role, 0, cpus, colocated, ALL)
            assert (hybrid.transports, hybrid.channels) == (["uv"], ["basic"]), (cpus, colocated)
    master = decide("HybridJob", "master", 0, 2, 3, ALL)  # waits: no polling
    assert (master.transports, master.channels) == (["uv"], ["basic"])


def test_levers_that_are_off_leave_torch_defaults():
    assert decide("PipelineJob", "stage", 0, 2, 2, set()) == ProcessTuning()
    s = decide("HybridJob", "trainer", 0, 2, 3, {"allocator"})
    assert s == ProcessTuning(arena_max=1, mkl_from_malloc=True)
    # glibc's arena and thresholds only where glibc's malloc is the one running.
    s = decide("HybridJob", "trainer", 0, 2, 3, {"allocator"}, "jemalloc")
    assert s == ProcessTuning(mkl_from_malloc=True)
    s = decide("HybridJob", "ps", 0, 4, 3, {"threads"})
    assert s == ProcessTuning(threads=2, passive_wait=True)


def test_rpc_backend_kwargs_follow_the_transport_lever():
    uv = {"_transports": ["uv"], "_channels": ["basic"]}
    stages, hybrid = ["master", "stage", "stage"], ["master", "ps", "trainer", "trainer"]
    local = {"PIPEJOB_ADDRESSES": ",".join(["127.0.0.1"] * 4)}  # what the world plan says
    kwargs = tuning.rpc_backend_kwargs
    assert kwargs("PipelineJob", "stage", 1, stages, 0, {}) == uv
    assert kwargs("PipelineJob", "stage", 1, stages, 0, {tuning.TUNING: "threads"}) == {}
    assert kwargs("PipelineJob", "stage", 1, stages, 2, {}) == {}
    assert kwargs("HybridJob", "master", 0, hybrid, 0, local) == uv
    spare = tuning.available_cpus() >= 2 * 3  # three compute processes on this host
    assert kwargs("HybridJob", "trainer", 2, hybrid, 0, local) == ({} if spare else uv)
    assert kwargs("HybridJob", "trainer", 2, hybrid, 0, {}) == uv  # hosts of their own


def test_apply_sets_thread_variables_unless_the_user_did():
    environ: dict[str, str] = {}
    applied = tuning.apply(ProcessTuning(threads=3, passive_wait=True), environ)
    assert environ == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}
    assert applied.threads == 3 and applied.passive_wait
    environ = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert not tuning.apply(ProcessTuning(passive_wait=True), environ).passive_wait
    assert environ == {"OMP_WAIT_POLICY": "ACTIVE"}
    environ = {"OMP_NUM_THREADS": "7"}
    applied = tuning.apply(ProcessTuning(threads=3), environ)
    assert environ == {"OMP_NUM_THREADS": "7"} and applied.threads is None
    environ = {"MALLOC_ARENA_MAX": "4"}
    assert tuning.apply(ProcessTuning(arena_max=1), environ).arena_max is None
    environ = {}
    assert tuning.apply(ProcessTuning(mkl_from_malloc=True), environ).mkl_from_malloc
    assert environ == {"MKL_DISABLE_FAST_MM": "1"}  # MKL's buffers from the malloc
    environ = {"MKL_DISABLE_FAST_MM": "0"}
    assert not tuning.apply(ProcessTuning(mkl_from_malloc=True), environ).mkl_from_malloc
    assert environ == {"MKL_DISABLE_FAST_MM": "0"}


def test_settings_reach_torch_when_applied_before_it_loads():
    """In a fresh interpreter, as the trainer's entry point does it: OpenMP sees the thread
    count in every thread, including ones torch starts itself."""
    code = """
import json, sys, threading
from pipejob.trainer.runtime import tuning
applied = tuning.apply(tuning.ProcessTuning(threads=1, arena_max=1))
import torch
seen = {}
def look():
    seen["other thread"] = torch.get_num_threads()
t = threading.Thread(target=look); t.start(); t.join()
print(json.dumps({"main": torch.get_num_threads(), **seen, "arena": applied.arena_max}))
"""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MALLOC_ARENA_MAX")
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"main": 1, "other thread": 1, "arena": 1}


MKL_THREADS = """
import ctypes, sys, threading
from pipejob.trainer.runtime import tuning
tuning.apply(tuning.ProcessTuning(threads=1, mkl_from_malloc=sys.argv[1] == "on"))
import torch
def in_use():
    value = ctypes.c_size_t()
    ctypes.CDLL(None).MallocExtension_GetNumericProperty(b"generic.current_allocated_bytes",
                                                         ctypes.byref(value))
    return value.value
layer = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024))
done, measured = threading.Barrier(13), threading.Event()
def step():
    layer(torch.randn(64, 1024)).sum().backward()
def thread():
    step()
    done.wait()
    measured.wait()  # alive while measured, as an RPC thread stays
step()
before = in_use()
threads = [threading.Thread(target=thread) for _ in range(12)]
[t.start() for t in threads]
done.wait()
print(in_use() - before)
measured.set()
"""


def test_mkl_takes_its_buffers_from_the_malloc_with_the_allocator_lever():
    """In fresh interpreters under tcmalloc, as a stage's RPC threads run its layers: with
    MKL's own cache, each thread that ran a matrix product holds buffers after it; with the
    lever's setting they go back to the malloc."""
    library = tuning_levers.library_file(tuning_levers.MALLOCS["tcmalloc"].library)
    if library is None:
        pytest.skip("tcmalloc is not installed here")
    env = {k: v for k, v in os.environ.items() if k != "MKL_DISABLE_FAST_MM"}
    env["LD_PRELOAD"] = library
    held = {}
    for lever in ("off", "on"):
        out = subprocess.run(
            [sys.executable, "-c", MKL_THREADS, lever],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        held[lever] = int(out.stdout.split()[-1])
    assert held["on"] < held["off"] / 2, held


def test_describe_names_what_is_set():
    assert tuning.ProcessTuning().describe() == "torch's defaults"
    text = ProcessTuning(1, True, 1, True, ["uv"], ["basic"], "glibc").describe()
    assert text == (
        "1 intra-op thread(s), passive OpenMP waits, malloc glibc with 1 arena(s) keeping"
        " freed memory, MKL buffers from the malloc, TensorPipe uv/basic"
    )
    missing = "tcmalloc is not installed here (Debian's libtcmalloc-minimal4)"
    text = ProcessTuning(arena_max=1, malloc="glibc", missing=missing).describe()
    assert text == f"malloc glibc with 1 arena(s) keeping freed memory: {missing}"
    assert ProcessTuning(malloc="jemalloc (libjemalloc.so.2)").describe() == (
        "malloc jemalloc (libjemalloc.so.2)"
    )


def test_every_process_runs_with_the_chosen_malloc_whoever_started_it(monkeypatch):
    """The local runner puts the malloc in its processes' env before they start; a process
    whose launcher did not (here stage0, as in the operator's pods) starts itself over with
    it. Each trainer's settings line, said before it loads torch (the world is stopped then),
    names the malloc it runs with, read from its loaded libraries: tcmalloc, or glibc's with
    the reason where this host lacks tcmalloc."""
    import io

    import pipejob.runner.local as local
    from jobrun import pipeline_job
    from pipejob.core import plan, spec

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv(tuning_levers.TUNING, raising=False)
    by_runner = tuning_levers.preload_env
    not_stage0 = lambda env: {} if env[c.RPC_NAME] == "stage0" else by_runner(env)  # noqa: E731
    monkeypatch.setattr(local.tuning_levers, "preload_env", not_stage0)
    job = spec.parse(pipeline_job("malloc", stages=2))
    processes = plan.plan_world(job, lambda m: local.LOOPBACK, plan.Ports(*local.free_ports(4)))
    out = io.StringIO()
    world = local.World(out)
    pattern = re.compile(r"^(\w+)\s*\| performance settings: .*?malloc ([^,]+)", re.M)
    try:
        world.start(processes)
        deadline = time.monotonic() + 50
        while len(pattern.findall(out.getvalue())) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        world.stop(grace=5)
    said = dict(pattern.findall(out.getvalue()))
    default = tuning_levers.MALLOCS[tuning_levers.DEFAULT_MALLOC]
    library = tuning_levers.library_file(default.library)
    if library:  # the linker's name (libtcmalloc_minimal.so.4) begins the mapped file's
        want = f"{default.name} ({library}"
    else:
        want = f"glibc with 1 arena(s) keeping freed memory: {default.name} is not installed here"
    assert said.keys() == {"master", "stage0", "stage1"}, out.getvalue()
    assert all(words.startswith(want) for words in said.values()), said


def test_the_trainer_s_entry_point_loads_no_torch_before_its_tuning():
    """Threads, the malloc and torch's C++ log level are read once, as torch loads: importing
    the entry point must not load it (a NonFiniteError imported from a torch module once did,
    and TensorPipe's warnings buried a failing world's one-line cause)."""
    code = "import sys, pipejob.trainer.__main__; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr
