import importlib.util
import os
from collections import defaultdict
from pathlib import Path

import pytest

from harness import docker

# The cluster fixtures need the operator and dev extras (kopf, kubernetes, kmock). A machine
# with the trainer alone (the GPU machine: benchmarks/device.sh) runs the tests needing none.
if importlib.util.find_spec("kmock") is not None:
    from harness.fixtures import (  # noqa: F401  (tests/harness)
        bridge,
        chart_operator,
        cluster,
        container_kubelet,
        coscheduling,
        crds,
        images,
        kubelet,
        kueue,
        operator,
        volcano,
    )


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`make test`), every test that runs containers goes to one worker:
    the images are built once there, and two docker-heavy worlds never share the 2 cores."""
    for item in items:
        if "images" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("containers"))


def pytest_runtest_setup(item):
    """`gpu` tests need CUDA: without it they skip here, in this one place, so pytest's
    summary gives them one line ("SKIPPED [n] tests/conftest.py: ..."). So do the container
    tests (those using the `images` fixture) without a docker daemon."""
    if "images" in getattr(item, "fixturenames", ()):
        reason = docker.unavailable()
        if reason:
            pytest.skip(f"CONTAINER TESTS SKIPPED, NOT RUN: {reason}")
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("gpu: torch.cuda is not available here; these tests need a CUDA GPU")


# Where the suite's time goes: every test's seconds (setup, call and teardown together), the
# slowest first, then each file's total. `make test` writes it; tests/README.md reads it.
DURATIONS_FILE = Path(os.environ.get("PIPEJOB_DURATIONS_FILE", "build/test-durations.txt"))
_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    """Add up each test's phases (under xdist these reach the controller too)."""
    _seconds[report.nodeid] += report.duration


def pytest_sessionfinish(session):
    """Write the durations file, once, from the process that saw every test."""
    if hasattr(session.config, "workerinput") or not _seconds:
        return
    by_file: dict[str, float] = defaultdict(float)
    for nodeid, seconds in _seconds.items():
        by_file[nodeid.split("::")[0]] += seconds
    lines = [f"{s:8.1f}  {n}" for n, s in sorted(_seconds.items(), key=lambda kv: -kv[1])]
    files = [f"{s:8.1f}  {n}" for n, s in sorted(by_file.items(), key=lambda kv: -kv[1])]
    total = sum(_seconds.values())
    DURATIONS_FILE.parent.mkdir(parents=True, exist_ok=True)
    DURATIONS_FILE.write_text(
        f"# {len(_seconds)} tests, {total:.0f} s of test time (workers add up)\n"
        "# by file\n" + "\n".join(files) + "\n# by test\n" + "\n".join(lines) + "\n"
    )
