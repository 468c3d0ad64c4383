"""The container-kubelet on its own: Pods made directly through the API run as docker
containers of the trainer image, and what each container sees from inside (its user, its
capabilities, its env, its files, its cgroup limits, its DNS names) comes back through its
termination message, as a kubelet reports it."""

from __future__ import annotations

import json

import pytest

from harness.client import Api
from harness.container_kubelet import ContainerKubelet

# The timeout bounds each test; the images fixture bounds its own build (scripts/images.sh).
pytestmark = pytest.mark.timeout(300, func_only=True)

NS = "default"
PODS = "v1/pods"

# Inside the container: what it is and what it may do, as JSON in the termination message.
SELF_REPORT = r"""
import json, os, socket, sys
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines())
try:
    open("/written-to-root", "w")
    root_writable = True
except OSError:
    root_writable = False
open("/scratch/x", "w").write("ok")
limit = "/sys/fs/cgroup/memory/memory.limit_in_bytes"
report = {
    "uid": os.getuid(), "gid": os.getgid(), "caps": status["CapEff"].strip(),
    "no_new_privs": status["NoNewPrivs"].strip(), "root_writable": root_writable,
    "config": open("/config/greeting").read(), "env": {k: os.environ.get(k) for k in
        ("POD_IP", "POD_NAME", "POD_NAMESPACE", "FROM_VAR")},
    "memory": int(open(limit).read()) if os.path.exists(limit) else None,
    "peers": sorted({a[4][0] for a in socket.getaddrinfo(sys.argv[1], None)}),
}
open("/tmp/report", "w").write(json.dumps(report))
"""


def pod(name: str, command: list[str], image: str, **spec) -> dict:
    container = {"name": "main", "image": image, "command": command}
    container |= spec.pop("container", {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "t"}},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def finished(api: Api, name: str, timeout: float = 120) -> dict:
    def check() -> dict | None:
        found = api.find(PODS, name, NS) or {}
        return found if found.get("status", {}).get("phase") in ("Succeeded", "Failed") else None

    return api.wait(f"pod {name} to finish", check, timeout)


def terminated(pod: dict) -> dict:
    return pod["status"]["containerStatuses"][0]["state"]["terminated"]


def test_a_pod_runs_as_its_security_context_with_its_env_volumes_limits_and_dns_names(
    cluster, container_kubelet: ContainerKubelet, images
):
    api = cluster.api
    api.create(
        "v1/configmaps",
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "settings"},
            "data": {"greeting": "hi"},
        },
        NS,
    )
    api.create(
        "v1/services",
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "t"},
            "spec": {"clusterIP": "None", "selector": {"app": "t"}},
        },
        NS,
    )
    api.create(
        PODS, pod("peer", ["sleep", "300"], images.trainer, hostname="peer", subdomain="t"), NS
    )
    peer = api.wait(
        "the peer's address", lambda: api.get(PODS, "peer", NS)["status"].get("podIP"), 60
    )
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "FROM_VAR", "value": "$(POD_NAME)-x"},
    ]
    security = {
        "runAsUser": 10002,
        "runAsGroup": 10003,
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    container = {
        "env": env,
        "securityContext": security,
        "terminationMessagePath": "/tmp/report",
        "resources": {"limits": {"cpu": "500m", "memory": "256Mi"}},
        "volumeMounts": [
            {"name": "scratch", "mountPath": "/scratch"},
            {"name": "config", "mountPath": "/config"},
        ],
    }
    volumes = [
        {"name": "scratch", "emptyDir": {}},
        {"name": "config", "configMap": {"name": "settings"}},
    ]
    api.create(
        PODS,
        pod(
            "probe",
            ["python", "-c", SELF_REPORT, "peer.t"],
            images.trainer,
            container=container,
            volumes=volumes,
            hostname="probe",
            subdomain="t",
        ),
        NS,
    )
    done = finished(api, "probe")
    assert done["status"]["phase"] == "Succeeded", done["status"]
    report = json.loads(terminated(done)["message"])
    assert (report["uid"], report["gid"]) == (10002, 10003)
    assert int(report["caps"], 16) == 0 and report["no_new_privs"] == "1"
    assert report["root_writable"] is False and report["config"] == "hi"
    ip = done["status"]["podIP"]
    assert report["env"] == {
        "POD_IP": ip,
        "POD_NAME": "probe",
        "POD_NAMESPACE": NS,
        "FROM_VAR": "probe-x",
    }
    assert report["memory"] in (None, 256 * 2**20)  # None: the host's cgroup is not v1
    assert report["peers"] == [peer]  # peer.t, its hostname.subdomain
    api.delete(PODS, "peer", NS)
    peers = lambda: [c for c in container_kubelet.containers() if "-peer-" in c]  # noqa: E731
    api.wait("the peer's container to be removed", lambda: not peers(), 60)


def test_run_as_non_root_refuses_a_root_user_before_any_container(
    cluster, container_kubelet: ContainerKubelet, images
):
    api = cluster.api
    root = {"securityContext": {"runAsUser": 0, "runAsNonRoot": True}}
    api.create(PODS, pod("rooted", ["true"], images.trainer, container=root), NS)

    def waiting() -> dict | None:
        statuses = api.get(PODS, "rooted", NS).get("status", {}).get("containerStatuses") or []
        return statuses[0]["state"].get("waiting") if statuses else None

    state = api.wait("the pod's container to be refused", waiting, 60)
    assert state["reason"] == "CreateContainerConfigError"
    assert "runAsNonRoot" in state["message"] and "root" in state["message"]
    assert api.get(PODS, "rooted", NS)["status"]["phase"] == "Pending"
    assert container_kubelet.containers() == []


def test_a_container_over_its_memory_limit_is_reported_oom_killed(
    cluster, container_kubelet: ContainerKubelet, images
):
    api = cluster.api
    hog = ["python", "-c", "b = [bytearray(2**20) for _ in range(1024)]"]  # 1 GiB
    limits = {"resources": {"limits": {"memory": "64Mi"}}}
    api.create(PODS, pod("hog", hog, images.trainer, container=limits), NS)
    done = finished(api, "hog")
    assert done["status"]["phase"] == "Failed"
    ended = terminated(done)
    assert (ended["reason"], ended["exitCode"]) == ("OOMKilled", 137), ended


def test_an_image_missing_on_the_node_is_err_image_pull(cluster, container_kubelet, images):
    api = cluster.api
    api.create(PODS, pod("ghost", ["true"], "pipejob/not-built:never"), NS)

    def waiting() -> dict | None:
        statuses = api.get(PODS, "ghost", NS).get("status", {}).get("containerStatuses") or []
        return statuses[0]["state"].get("waiting") if statuses else None

    assert api.wait("the image pull to fail", waiting, 60)["reason"] == "ErrImagePull"
    assert container_kubelet.containers() == []
