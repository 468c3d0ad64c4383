"""spec.template: the overrides a user gives every pod of a job (image, resources, node
selection, volumes, env, ...), each Kubernetes object checked against its real schema
(core/k8s.py). Only the operator reads it."""

from __future__ import annotations

from pipejob.core.k8s import KubeObject
from pipejob.core.schema import Field, Rule

GPU = "nvidia.com/gpu"


def _k8s_field(name: str, description: str) -> Field:
    """A Kubernetes object passed to the pods, checked against its real schema (core/k8s.py)."""
    return Field("object", f"{description.rstrip('.')} (Kubernetes core/v1 {name}).", k8s=name)


def _k8s_list_field(name: str, description: str, keys: tuple[str, ...] = ()) -> Field:
    item = _k8s_field(name, f"One {name}.")
    what = f"{description.rstrip('.')} (Kubernetes core/v1 {name} list)."
    return Field("array", what, items=item, list_map_keys=keys)


def _has_no_gpu(template: KubeObject) -> bool:
    """Whether a pod template's resources name no GPUs (the spec's GPU fields give them)."""
    resources = template.get("resources") or {}
    return all(GPU not in (resources.get(k) or {}) for k in ("requests", "limits"))


TEMPLATE = Field(
    "object",
    "Overrides for every pod of the job: the operator's defaults apply where this is silent.",
    fields={
        "image": Field("string", "Trainer container image.", max_length=4096),
        "imagePullPolicy": Field(
            "string", "Image pull policy.", enum=("Always", "IfNotPresent", "Never")
        ),
        "resources": _k8s_field(
            "ResourceRequirements",
            "Container resources; GPU counts come from the spec's GPU fields.",
        ),
        "nodeSelector": Field(
            "object",
            "Node labels the pods must match.",
            values=Field("string", "Label value.", max_length=63),
        ),
        "tolerations": _k8s_list_field("Toleration", "Taints the pods tolerate."),
        "affinity": _k8s_field("Affinity", "Node and pod affinity of the pods."),
        "volumes": _k8s_list_field("Volume", "Volumes of the pods.", ("name",)),
        "volumeMounts": _k8s_list_field(
            "VolumeMount", "Where the trainer container mounts them.", ("mountPath",)
        ),
        "env": _k8s_list_field("EnvVar", "Extra environment of the trainer container.", ("name",)),
        "serviceAccountName": Field("string", "Service account of the pods.", max_length=253),
        "schedulerName": Field(
            "string",
            "Scheduler of the pods; a gang scheduler is set with spec.scheduling.",
            max_length=253,
        ),
        "priorityClassName": Field("string", "Priority class of the pods.", max_length=253),
    },
    rules=(
        Rule(
            "!has(self.resources) || ((!has(self.resources.limits) || !('nvidia.com/gpu' in"
            " self.resources.limits)) && (!has(self.resources.requests) || !('nvidia.com/gpu'"
            " in self.resources.requests)))",
            "nvidia.com/gpu comes from the spec's GPU field (gpusPerStage, gpusPerTrainer),"
            " never from template.resources",
            "resources",
            _has_no_gpu,
        ),
    ),
)
