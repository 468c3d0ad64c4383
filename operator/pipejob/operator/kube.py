"""Plain-dict Kubernetes objects of a job: its headless Service, its world's NetworkPolicy and
one Pod per process of the world plan. Pure: the controller creates what these return,
`pipejob render` prints it."""

from __future__ import annotations

import copy
import hashlib
import json
import os

from pipejob.core import master_first
from pipejob.core.contract import POD_NAME
from pipejob.core.k8s import KubeObject
from pipejob.core.plan import (
    TRAINER_MODULE,
    Member,
    Ports,
    Process,
    groups,
    members,
    plan_world,
)
from pipejob.core.spec import API_VERSION, Job
from pipejob.operator import gang
from pipejob.operator.policy_settings import DEFAULT, NetworkPolicySettings

JOB_LABEL = "pipejob.dev/job"
ROLE_LABEL = "pipejob.dev/role"
INDEX_LABEL = "pipejob.dev/index"
REPLICA_LABEL = "pipejob.dev/replica"  # only on the pods of replicated roles
RESTART_LABEL = "pipejob.dev/restart"
SPEC_HASH = "pipejob.dev/spec-hash"  # annotation: the spec a pod was made from
MANAGED_BY = {"app.kubernetes.io/managed-by": "pipejob"}

CONTAINER = "trainer"
GPU = "nvidia.com/gpu"

IMAGE_ENV = "PIPEJOB_TRAINER_IMAGE"
DEFAULT_IMAGE = "ghcr.io/pipejob/trainer:0.1.0"

PORTS = Ports()

# Restricted Pod Security Standard: what the trainer needs and nothing more.
POD_SECURITY = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}

# Template fields copied to the pod spec as they are, when given.
_POD_FIELDS = (
    "nodeSelector",
    "tolerations",
    "affinity",
    "volumes",
    "serviceAccountName",
    "schedulerName",
    "priorityClassName",
)


# Fields that steer the job, not its pods: changing them never recreates the world.
RUN_CONTROL = (
    "suspend",
    "backoffLimit",
    "activeDeadlineSeconds",
    "ttlSecondsAfterFinished",
    "oom",
    "managedBy",
)


def spec_hash(job: Job) -> str:
    """A digest of everything in the spec that the pods are made from."""
    world_spec = {k: v for k, v in job.spec.items() if k not in RUN_CONTROL}
    text = json.dumps(world_spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def spec_hash_of(pod_obj: KubeObject) -> str | None:
    return (pod_obj["metadata"].get("annotations") or {}).get(SPEC_HASH)


def trainer_image() -> str:
    """The operator's default trainer image; a job's spec.template.image overrides it."""
    return os.environ.get(IMAGE_ENV) or DEFAULT_IMAGE


def pod_name(job_name: str, member: Member) -> str:
    return f"{job_name}-{member.label}"


def addresser(job: Job):
    """A member's DNS name: `<pod>.<service>` (hostname + subdomain of the headless Service)."""
    return lambda member: f"{pod_name(job.name, member)}.{job.name}"


def owner_reference(job_obj: KubeObject) -> KubeObject:
    """The job as the controller owner of what it makes: deleting the job deletes them."""
    meta = job_obj["metadata"]
    return {
        "apiVersion": job_obj.get("apiVersion", API_VERSION),
        "kind": job_obj["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(
    job: Job, name: str, namespace: str, owner: KubeObject | None, labels: dict[str, str]
) -> KubeObject:
    meta: KubeObject = {
        "name": name,
        "namespace": namespace,
        "labels": {JOB_LABEL: job.name, **labels, **MANAGED_BY},
    }
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


def service(job: Job, namespace: str, owner: KubeObject | None = None) -> KubeObject:
    """The headless Service that gives every pod of the job its DNS name, ready or not."""
    names = ["rpc", "preflight", "monitor"]
    if groups(job, members(job)):
        names.insert(1, "ddp")
    ports = [{"name": n, "port": getattr(PORTS, n), "targetPort": getattr(PORTS, n)} for n in names]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, job.name, namespace, owner, {}),
        "spec": {
            "clusterIP": "None",
            # Workers must resolve the master before it is ready: the rendezvous needs it.
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: job.name},
            "ports": ports,
        },
    }


# DNS, which a world with restricted egress still needs to find its members by name.
DNS = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]


def network_policy(
    job: Job, namespace: str, owner: KubeObject | None, settings: NetworkPolicySettings
) -> KubeObject:
    """The NetworkPolicy of the job's world: its pods admit only each other (every world of
    the job, at any size: the selector is the job's label), and the master's monitor port
    also the peers `settings` name. No port list between members: torch RPC (TensorPipe) and
    gloo connect every pair on ports each process picks as it starts; only the rendezvous
    ports are fixed, and a member is trusted with everything anyway (RPC runs what it is
    sent). Egress stays open unless `settings` restrict it."""

    def peers() -> KubeObject:  # a fresh dict per use: YAML would print a shared one as an alias
        return {"podSelector": {"matchLabels": {JOB_LABEL: job.name}}}

    ingress: list[dict] = [{"from": [peers()]}]
    if settings.monitor_from:  # an empty `from` would admit everyone
        monitor = [{"protocol": "TCP", "port": PORTS.monitor}]
        ingress.append({"from": copy.deepcopy(list(settings.monitor_from)), "ports": monitor})
    spec: KubeObject = {**peers(), "policyTypes": ["Ingress"], "ingress": ingress}
    if settings.egress is not None:
        spec["policyTypes"].append("Egress")
        spec["egress"] = [
            {"to": [peers()]},
            {"ports": copy.deepcopy(DNS)},
            *copy.deepcopy(list(settings.egress)),
        ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, job.name, namespace, owner, {}),
        "spec": spec,
    }


def _resources(template: KubeObject, gpus: int) -> KubeObject:
    """Template resources with the GPU count of the role (and only that) as nvidia.com/gpu."""
    resources = copy.deepcopy(template.get("resources") or {})
    for key in ("requests", "limits"):
        section = {k: v for k, v in (resources.get(key) or {}).items() if k != GPU}
        if gpus > 0:
            section[GPU] = gpus
        if section:
            resources[key] = section
        else:
            resources.pop(key, None)
    return resources


def pod(
    job: Job,
    process: Process,
    restart: int,
    namespace: str,
    owner: KubeObject | None = None,
    image: str | None = None,
) -> KubeObject:
    """The Pod of one process of the world plan, in world `restart` (0 for the first)."""
    template = job.spec.get("template") or {}
    hostname = pod_name(job.name, process.member)  # the DNS name stays across worlds
    name = gang.pod_name(job, hostname, restart)
    spec: KubeObject = {
        "hostname": hostname,
        "subdomain": job.name,
        "restartPolicy": "Never",  # the operator restarts the whole world, never one pod
        "enableServiceLinks": False,
        # Training pods never talk to the Kubernetes API unless the user gives them an account.
        "automountServiceAccountToken": bool(template.get("serviceAccountName")),
        "securityContext": copy.deepcopy(POD_SECURITY),
        "containers": [_container(job, process, name, image)],
    }
    for key in _POD_FIELDS:
        if template.get(key):
            spec[key] = copy.deepcopy(template[key])
    labels = {
        ROLE_LABEL: process.role,
        INDEX_LABEL: str(process.member.index),
        **({REPLICA_LABEL: str(process.member.replica)} if process.member.replicated else {}),
        RESTART_LABEL: str(restart),
    }
    meta = _metadata(job, name, namespace, owner, labels)
    meta["annotations"] = {SPEC_HASH: spec_hash(job)}
    pod_obj = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
    return gang.decorate(job, pod_obj, process.world_size)


def _container(job: Job, process: Process, name: str, image: str | None) -> KubeObject:
    """The trainer's container of the pod `name` of `process`: its env, ports, image,
    resources and volumes."""
    template = job.spec.get("template") or {}
    env = [{"name": k, "value": v} for k, v in process.env.items()]
    # The watchdog names a member by its pod (the name changes with every restart).
    env.append({"name": POD_NAME, "value": name})
    env += copy.deepcopy(template.get("env") or [])
    container: KubeObject = {
        "name": CONTAINER,
        "image": template.get("image") or image or trainer_image(),
        "command": ["python", *TRAINER_MODULE],
        "env": env,
        "ports": _container_ports(process),
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
        # A failed trainer writes its one-line reason to the termination message (else its
        # last log lines become it), so the job's status can say why it failed.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if template.get("imagePullPolicy"):
        container["imagePullPolicy"] = template["imagePullPolicy"]
    resources = _resources(template, process.gpus)
    if resources:
        container["resources"] = resources
    mounts = copy.deepcopy(template.get("volumeMounts") or [])
    checkpoint = job.spec.get("checkpoint") or {}
    if checkpoint.get("volume"):  # every process of the job reads and writes the checkpoint
        mounts.append({"name": checkpoint["volume"], "mountPath": checkpoint["path"]})
    if mounts:
        container["volumeMounts"] = mounts
    return container


def _container_ports(process: Process) -> list[KubeObject]:
    ports = [{"name": "rpc", "containerPort": PORTS.rpc}]
    if process.seat is not None:
        ports.append({"name": "ddp", "containerPort": process.seat.port})
    if process.rank == 0:  # the master holds the preflight group's store and serves /progress
        ports += [
            {"name": "preflight", "containerPort": PORTS.preflight},
            {"name": "monitor", "containerPort": PORTS.monitor},
        ]
    return ports


def world(
    job: Job,
    restart: int,
    namespace: str,
    owner: KubeObject | None = None,
    image: str | None = None,
) -> list[KubeObject]:
    """Every Pod of the job, in RPC rank order (master first); where the master is made first
    (master_first.on_cluster), every member is told so."""
    processes = plan_world(job, addresser(job))
    if master_first.on_cluster(job):
        processes = master_first.told(processes, master_first.PODS)
    return [pod(job, p, restart, namespace, owner, image) for p in processes]


def render(
    job: Job,
    namespace: str,
    image: str | None = None,
    policy: NetworkPolicySettings | None = DEFAULT,
) -> list[KubeObject]:
    """The Service, NetworkPolicy (unless `policy` is None), PodGroup (with spec.scheduling
    volcano or coscheduling) and Pods the operator creates for `job`, in that order, without
    owner references (there is no job object yet), for review and `kubectl apply --dry-run`."""
    pods = world(job, 0, namespace, None, image)
    group = gang.podgroup(job, pods, namespace, None)
    guard = network_policy(job, namespace, None, policy) if policy is not None else None
    return [service(job, namespace), *filter(None, (guard, group)), *pods]


def role_of(pod_obj: KubeObject) -> str:
    return pod_obj["metadata"].get("labels", {}).get(ROLE_LABEL, "unknown")


def restart_of(pod_obj: KubeObject) -> int | None:
    value = pod_obj["metadata"].get("labels", {}).get(RESTART_LABEL)
    return int(value) if value is not None and value.isdigit() else None


def process_name(pod_obj: KubeObject) -> str:
    """How a user names a pod's process: "master 0", "stage 1", "trainer 0"."""
    labels = pod_obj["metadata"].get("labels", {})
    name = f"{labels.get(ROLE_LABEL, '?')} {labels.get(INDEX_LABEL, '?')}"
    replica = labels.get(REPLICA_LABEL)
    return name if replica is None else f"{name} of replica {replica}"


def world_size(job: Job) -> int:
    return len(members(job))
