"""pytest fixtures of the harness (tests/conftest.py imports them): a cluster, a node, the
CRDs, the operator. Each is per test and tears down completely, processes included."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from harness import jobs, network
from harness.cluster import Cluster
from harness.kubelet import Kubelet
from harness.operator_process import OperatorProcess

CRDS_DIR = Path(__file__).resolve().parents[2] / "crds"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """The API server emulator, empty, on 127.0.0.1."""
    with Cluster(tmp_path / "cluster") as c:
        yield c


@pytest.fixture
def kubelet(cluster: Cluster, tmp_path: Path) -> Iterator[Kubelet]:
    """A process-kubelet node running the cluster's pods as local processes."""
    reason = network.unavailable()
    if reason:
        pytest.skip(reason)
    with Kubelet(cluster.api, tmp_path / "node") as node:
        yield node
        for run in node.runs():  # shown by pytest when the test failed
            log = node.logs(run.namespace, run.name)[-3000:]
            print(f"--- log of pod {run.namespace}/{run.name} ---\n{log}")


@pytest.fixture
def crds(cluster: Cluster) -> list[dict]:
    """The product's CRDs from crds/, applied."""
    return [jobs.apply_crd(cluster.api, yaml.safe_load(p.read_text()))
            for p in sorted(CRDS_DIR.glob("*.yaml"))]  # fmt: skip


@pytest.fixture
def operator(request: pytest.FixtureRequest, cluster: Cluster, crds: list[dict],
             tmp_path: Path) -> Iterator[OperatorProcess]:  # fmt: skip
    """`pipejob operator` serving the cluster's namespace. With a kubelet in the test, it runs
    in the pod network, as its own pod would (it reads the masters' /progress there)."""
    network = None
    if "kubelet" in request.fixturenames:
        network = request.getfixturevalue("kubelet").network
        network.forward(cluster.port)  # the API server, at the kubeconfig's address
    op = OperatorProcess(cluster.kubeconfig, cluster.namespace, tmp_path / "operator.log",
                         network=network)  # fmt: skip
    op.start()
    try:
        yield op
    finally:
        op.stop()
        print(f"--- operator log (end) ---\n{op.logs()[-6000:]}")
