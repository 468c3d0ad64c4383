"""Per-process performance settings: the pure decisions, and applying them before torch loads."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from pipejob.trainer.runtime import tuning
from pipejob.trainer.runtime.tuning import Settings, decide

pytestmark = pytest.mark.timeout(60)

ALL = set(tuning.LEVERS)
PIPELINE_WORLD = ["master", "stage", "stage"]  # roles in rank order


def test_levers_from_the_environment_variable():
    assert tuning.levers(None) == ALL
    assert tuning.levers("on") == ALL
    assert tuning.levers(" ") == ALL
    assert tuning.levers("off") == set()
    assert tuning.levers("threads, transport") == {"threads", "transport"}


def test_an_unknown_lever_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match=r"PIPEJOB_TUNING='threads,turbo'.*turbo"):
        tuning.levers("threads,turbo")


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


def test_compute_roles_oversubscribe_only_a_share_under_two_cores():
    assert decide("PipelineJob", "stage", 0, 2, 2, ALL).threads == 2
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
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=50, check=True, preexec_fn=pin)  # fmt: skip
        available, threads[len(cpus)] = out.stdout.split()
        assert float(available) <= len(cpus)  # a cgroup quota may bound it further
        # 2 stages share the CPUs: twice each one's half, that is all of them.
        assert int(threads[len(cpus)]) == max(1, math.floor(float(available)))
    assert threads[1] == "1"


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
    for role in ("trainer", "ps"):  # latency-bound: shm's polling helps
        hybrid = decide("HybridJob", role, 0, 2, 3, ALL)
        assert (hybrid.transports, hybrid.channels) == (None, None)
    master = decide("HybridJob", "master", 0, 2, 3, ALL)  # waits: no polling
    assert (master.transports, master.channels) == (["uv"], ["basic"])


def test_levers_that_are_off_leave_torch_defaults():
    assert decide("PipelineJob", "stage", 0, 2, 2, set()) == Settings()
    s = decide("HybridJob", "trainer", 0, 2, 3, {"allocator"})
    assert s == Settings(arena_max=1)
    s = decide("HybridJob", "ps", 0, 4, 3, {"threads"})
    assert s == Settings(threads=2, passive_wait=True)


def test_rpc_backend_kwargs_follow_the_transport_lever():
    uv = {"_transports": ["uv"], "_channels": ["basic"]}
    assert tuning.rpc_backend_kwargs("PipelineJob", "stage", 0, {}) == uv
    assert tuning.rpc_backend_kwargs("PipelineJob", "stage", 0, {tuning.TUNING: "threads"}) == {}
    assert tuning.rpc_backend_kwargs("PipelineJob", "stage", 2, {}) == {}
    assert tuning.rpc_backend_kwargs("HybridJob", "trainer", 0, {}) == {}
    assert tuning.rpc_backend_kwargs("HybridJob", "master", 0, {}) == uv


def test_apply_sets_thread_variables_unless_the_user_did():
    environ: dict[str, str] = {}
    applied = tuning.apply(Settings(threads=3, passive_wait=True), environ)
    assert environ == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}
    assert applied.threads == 3 and applied.passive_wait
    environ = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert not tuning.apply(Settings(passive_wait=True), environ).passive_wait
    assert environ == {"OMP_WAIT_POLICY": "ACTIVE"}
    environ = {"OMP_NUM_THREADS": "7"}
    applied = tuning.apply(Settings(threads=3), environ)
    assert environ == {"OMP_NUM_THREADS": "7"} and applied.threads is None
    environ = {"MALLOC_ARENA_MAX": "4"}
    assert tuning.apply(Settings(arena_max=1), environ).arena_max is None


def test_settings_reach_torch_when_applied_before_it_loads():
    """In a fresh interpreter, as the trainer's entry point does it: OpenMP sees the thread
    count in every thread, including ones torch starts itself."""
    code = """
import json, sys, threading
from pipejob.trainer.runtime import tuning
applied = tuning.apply(tuning.Settings(threads=1, arena_max=1))
import torch
seen = {}
def look():
    seen["other thread"] = torch.get_num_threads()
t = threading.Thread(target=look); t.start(); t.join()
print(json.dumps({"main": torch.get_num_threads(), **seen, "arena": applied.arena_max}))
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MALLOC_ARENA_MAX")}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=50, check=True)  # fmt: skip
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"main": 1, "other thread": 1, "arena": 1}


def test_describe_names_what_is_set():
    assert tuning.Settings().describe() == "torch's defaults"
    text = Settings(1, True, 1, ["uv"], ["basic"]).describe()
    assert text == (
        "1 intra-op thread(s), passive OpenMP waits, 1 malloc arena(s) keeping"
        " freed memory, TensorPipe uv/basic"
    )
