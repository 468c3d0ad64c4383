"""A process's peak memory (runtime/memory.py), measured for real in this process: the figures
every member reports in the summary, /progress and the job's status."""

from __future__ import annotations

import gc

import pytest
import torch

from pipejob.trainer.runtime import memory

pytestmark = pytest.mark.timeout(60)

MB = 1 << 20


def test_the_peak_follows_what_the_process_touched_and_starts_over_on_reset():
    memory.reset_peak()
    before = memory.peak()["rssPeakBytes"]
    assert before >= memory.status_kb("VmRSS") * 1024 - 16 * MB  # the peak restarts at now
    held = torch.ones(256 * MB // 4)  # 256 MB, every page written
    during = memory.peak()["rssPeakBytes"]
    assert during - before >= 240 * MB, (before, during)  # pages, not bytes: a little slack
    del held
    gc.collect()
    # A peak stays after the memory goes (give or take a few pages: the kernel's RSS counters
    # are cached per thread and synced lazily).
    assert memory.peak()["rssPeakBytes"] >= during - MB
    memory.reset_peak()
    assert memory.peak()["rssPeakBytes"] < during - 200 * MB  # once returned to the system


def test_a_process_that_used_no_gpu_reports_no_gpu_figure():
    figures = memory.peak()
    assert set(figures) == (
        {"rssPeakBytes", "cudaPeakBytes"}
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else {"rssPeakBytes"}
    )
    assert memory.megabytes({"rssPeakBytes": 812_000_000}) == "812 MB"
    assert (
        memory.megabytes({"rssPeakBytes": 812_000_000, "cudaPeakBytes": 2_048_000_000})
        == "812 MB, GPU 2048 MB"
    )
