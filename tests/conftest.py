import importlib.util

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
