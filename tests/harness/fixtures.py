"""pytest fixtures of the harness (tests/conftest.py imports them): a cluster, a node, the
CRDs, the operator. Each is per test and tears down completely, processes included."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from harness import gang, jobs, network
from harness.cluster import Cluster
from harness.kubelet import Kubelet
from harness.kueue import Kueue
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
def kueue(cluster: Cluster) -> Iterator[Kueue]:
    """Kueue with its plain-pod integration; LocalQueue `team-a` admits any group, and tests
    may change `kueue.queues` (pods per queue) to hold groups back."""
    with Kueue(cluster, {"team-a": None}) as k:
        yield k


def _gang(cluster: Cluster, flavour: gang.Flavour) -> Iterator[gang.GangScheduler]:
    jobs.apply_crd(cluster.api, gang.crd(flavour))
    with gang.GangScheduler(cluster.api, flavour, Kubelet.NODE) as scheduler:
        yield scheduler


@pytest.fixture
def volcano(cluster: Cluster) -> Iterator[gang.GangScheduler]:
    """Volcano's gang scheduling of PodGroups (scheduling.volcano.sh), served CRD included."""
    yield from _gang(cluster, gang.VOLCANO)


@pytest.fixture
def coscheduling(cluster: Cluster) -> Iterator[gang.GangScheduler]:
    """The coscheduling plugin's scheduler of PodGroups (scheduling.x-k8s.io)."""
    yield from _gang(cluster, gang.COSCHEDULING)


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
    # The process-kubelet's pods share one host: hostPath is how they share a directory
    # (a checkpoint), so this operator allows node-level volumes, as a kind cluster's might.
    args = ("--allow-node-volumes",) if network is not None else ()
    op = OperatorProcess(cluster.kubeconfig, cluster.namespace, tmp_path / "operator.log",
                         network=network, args=args)  # fmt: skip
    op.start()
    try:
        yield op
    finally:
        op.stop()
        print(f"--- operator log (end) ---\n{op.logs()[-6000:]}")
