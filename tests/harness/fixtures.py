"""pytest fixtures of the harness (tests/conftest.py imports them): a cluster, a node, the
CRDs, the operator. Each is per test and tears down completely, processes included."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import static_tools
import yaml

from harness import docker, gang, jobs, network
from harness.cluster import Cluster
from harness.container_kubelet import ContainerKubelet
from harness.deployments import DeploymentController
from harness.incluster import InClusterAccess
from harness.kubelet import Kubelet
from harness.kueue import Kueue
from harness.operator_process import OperatorProcess
from pipejob.operator.kube import IMAGE_ENV

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
    return [
        jobs.apply_crd(cluster.api, yaml.safe_load(p.read_text()))
        for p in sorted(CRDS_DIR.glob("*.yaml"))
    ]


@pytest.fixture
def operator(
    request: pytest.FixtureRequest, cluster: Cluster, crds: list[dict], tmp_path: Path
) -> Iterator[OperatorProcess]:
    """`pipejob operator` serving the cluster's namespace. With a kubelet in the test, it runs
    in the pod network, as its own pod would (it reads the masters' /progress there)."""
    network = None
    if "kubelet" in request.fixturenames:
        network = request.getfixturevalue("kubelet").network
        network.forward(cluster.port)  # the API server, at the kubeconfig's address
    # The process-kubelet's pods share one host: hostPath is how they share a directory
    # (a checkpoint), so this operator allows node-level volumes, as a kind cluster's might.
    args = ("--allow-node-volumes",) if network is not None else ()
    op = OperatorProcess(
        cluster.kubeconfig, cluster.namespace, tmp_path / "operator.log", network=network, args=args
    )
    op.start()
    try:
        yield op
    finally:
        op.stop()
        print(f"--- operator log (end) ---\n{op.logs()[-6000:]}")


@pytest.fixture(scope="session")
def images() -> docker.Images:
    """The operator and trainer images, built from the checkout once per test run. Without a
    docker daemon, the tests using this skip before it is made (tests/conftest.py), with one
    line in pytest's summary."""
    return docker.build_images()


@pytest.fixture
def bridge(images: docker.Images) -> Iterator[docker.Network]:
    """A docker bridge network of the test's own (internal: nothing outside is reachable)."""
    net = docker.Network()
    try:
        yield net
    finally:
        net.close()


@pytest.fixture
def container_kubelet(
    cluster: Cluster,
    bridge: docker.Network,
    images: docker.Images,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[ContainerKubelet]:
    """A container-kubelet node running the cluster's pods as docker containers on `bridge`.
    An operator started after it makes pods of the trainer image built from the checkout."""
    monkeypatch.setenv(IMAGE_ENV, images.trainer)
    # Pods reach the API server over TLS at the host's address on the bridge, as in-cluster.
    access = InClusterAccess(tmp_path / "in-cluster", bridge.gateway, cluster.port)
    try:
        with ContainerKubelet(cluster.api, tmp_path / "node", bridge, access) as node:
            yield node
            for run in node.runs():  # shown by pytest when the test failed
                log = node.logs(run.namespace, run.name)[-3000:]
                print(f"--- log of pod {run.namespace}/{run.name} (container) ---\n{log}")
    finally:
        access.close()


@pytest.fixture
def chart_operator(
    cluster: Cluster, container_kubelet: ContainerKubelet, images: docker.Images, tmp_path: Path
) -> Iterator[dict]:
    """The operator as users install it: `helm install` of the chart (CRDs included) into
    namespace pipejob-system, its Deployment made a Pod by a Deployment controller, run from
    the operator image by the container-kubelet. Yields that pod once it runs.
    `--server-side=false`: helm 4 applies with server-side apply by default, which the
    emulator does not implement (helm 3's client-side apply instead; docs/images.md). No
    `--create-namespace`: the emulator cannot create Namespace objects, and serves any
    namespace without one."""
    repository, tag = images.operator.rsplit(":", 1)
    helm = {
        f"HELM_{d}_HOME": str(tmp_path / "helm" / d.lower()) for d in ("CACHE", "CONFIG", "DATA")
    }
    with DeploymentController(cluster.api):
        done = subprocess.run(
            [
                static_tools.tool("helm"),
                "install",
                "pipejob",
                str(static_tools.CHART),
                "--namespace",
                static_tools.NAMESPACE,
                "--server-side=false",
                "--set",
                f"image.repository={repository}",
                "--set",
                f"image.tag={tag}",
                "--set",
                f"trainerImage={images.trainer}",
                "--set",
                "logLevel=debug",
            ],
            env={**os.environ, **helm, "KUBECONFIG": str(cluster.kubeconfig)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"helm install failed:\n{done.stderr[-3000:]}"

        def running() -> dict | None:
            pods = cluster.api.list("v1/pods", static_tools.NAMESPACE)
            return next((p for p in pods if p.get("status", {}).get("phase") == "Running"), None)

        yield cluster.api.wait("the operator's pod to run", running, 120)
