"""`spec.scheduling`: gang admission of a job's world by Kueue, Volcano or the coscheduling
plugin, so a world starts whole or not at all. Only the operator reads it (`pipejob run`
ignores it); this module holds its table, its rules and the names each scheduler reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from pipejob.core.k8s import KubeObject
from pipejob.core.schema import Field, Rule

KUEUE, VOLCANO, COSCHEDULING = "kueue", "volcano", "coscheduling"
PROVIDERS = (KUEUE, VOLCANO, COSCHEDULING)

# Kueue's plain-pod groups (kueue.sigs.k8s.io, "Run Plain Pods").
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_RETRIABLE = "kueue.x-k8s.io/retriable-in-group"  # "false" ends the group
KUEUE_GATE = "kueue.x-k8s.io/admission"  # the scheduling gate Kueue's webhook adds
KUEUE_FINALIZER = "kueue.x-k8s.io/managed"

# Kueue's topology-aware scheduling (TAS): the node label level a pod set must, or should,
# fit in one domain of (kueue.sigs.k8s.io, "Run Workloads with Topology-Aware Scheduling").
KUEUE_REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
KUEUE_PREFERRED_TOPOLOGY = "kueue.x-k8s.io/podset-preferred-topology"
TOPOLOGY_ANNOTATIONS = {"required": KUEUE_REQUIRED_TOPOLOGY, "preferred": KUEUE_PREFERRED_TOPOLOGY}

# spec.managedBy: the controller that runs the job. pipejob's own, or left out: the operator;
# any other (MultiKueue's, which runs it on a worker cluster): the operator leaves it alone.
MANAGED_BY_PIPEJOB = "pipejob.dev/operator"
MULTIKUEUE = "kueue.x-k8s.io/multikueue"

# Volcano: the PodGroup a pod belongs to (without it Volcano makes a minMember-1 group).
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
VOLCANO_API = ("scheduling.volcano.sh", "v1beta1", "podgroups")
VOLCANO_SCHEDULER = "volcano"

# kubernetes-sigs/scheduler-plugins coscheduling, run as a second scheduler.
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
COSCHEDULING_API = ("scheduling.x-k8s.io", "v1alpha1", "podgroups")
COSCHEDULING_SCHEDULER = "scheduler-plugins-scheduler"

DEFAULT_SCHEDULERS = {VOLCANO: VOLCANO_SCHEDULER, COSCHEDULING: COSCHEDULING_SCHEDULER}


def _read_by_only(provider: str, key: str) -> Rule:
    return Rule(
        f"!has(self.{key}) || self.provider == '{provider}'",
        f"{key} is read by {provider} only",
        key,
        lambda s: key not in s or s["provider"] == provider,
    )


SCHEDULING = Field(
    "object",
    "Gang admission of the job's world: every pod is admitted together, or none is. kueue:"
    " the pods form one Kueue plain-pod group in a LocalQueue; volcano and coscheduling: the"
    " operator makes a PodGroup of the world. Ignored by `pipejob run`.",
    fields={
        "provider": Field(
            "string", "Who admits the world: kueue, volcano or coscheduling.", enum=PROVIDERS
        ),
        "queue": Field(
            "string",
            "kueue: the LocalQueue of the job's namespace (required). volcano: the Volcano"
            " queue (default: Volcano's `default`).",
            pattern=r"[a-z0-9]([-.a-z0-9]*[a-z0-9])?",
            max_length=63,
        ),
        "priorityClassName": Field(
            "string",
            "Priority class of the pods (and of a Volcano PodGroup): who preempts whom.",
            pattern=r"[a-z0-9]([-.a-z0-9]*[a-z0-9])?",
            max_length=253,
        ),
        "schedulerName": Field(
            "string",
            "volcano and coscheduling: the scheduler of the pods (default: volcano, and"
            " scheduler-plugins-scheduler, the plugins' second scheduler).",
            max_length=253,
        ),
        "scheduleTimeoutSeconds": Field(
            "integer",
            "coscheduling: how long the PodGroup may wait for all its members before the"
            " plugin lets the pods go back to the queue (the plugin's default when unset).",
            minimum=1,
            maximum=24 * 3600,
        ),
    },
    required=("provider",),
    section=True,
    rules=(
        Rule(
            "self.provider != 'kueue' || has(self.queue)",
            "kueue needs the LocalQueue the world is queued in",
            "queue",
            lambda s: s["provider"] != KUEUE or "queue" in s,
        ),
        Rule(
            "!has(self.queue) || self.provider != 'coscheduling'",
            "coscheduling has no queues: leave queue out",
            "queue",
            lambda s: "queue" not in s or s["provider"] != COSCHEDULING,
        ),
        _read_by_only(COSCHEDULING, "scheduleTimeoutSeconds"),
        Rule(
            "!has(self.schedulerName) || self.provider != 'kueue'",
            "kueue works with the pods' own scheduler: set template.schedulerName instead",
            "schedulerName",
            lambda s: "schedulerName" not in s or s["provider"] != KUEUE,
        ),
    ),
)


# A node label key: an optional DNS-subdomain prefix and "/", then a name of 63 at most.
_LABEL_KEY = (
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)


def _level(which: str, how: str) -> Field:
    return Field(
        "string",
        f"The node label of the topology level (e.g. cloud.provider.com/topology-rack) whose one"
        f" domain the world's pods {how} fit in: Kueue's {TOPOLOGY_ANNOTATIONS[which]}.",
        pattern=_LABEL_KEY,
        pattern_says="be a node label key such as cloud.provider.com/topology-rack",
        max_length=317,
    )


TOPOLOGY = Field(
    "object",
    "Kueue topology-aware scheduling of the world (needs spec.scheduling.provider kueue and a"
    " ClusterQueue with a topology): its pods in one block or rack, its stages close"
    " together. One of required or preferred.",
    fields={"required": _level("required", "must"), "preferred": _level("preferred", "should")},
    section=True,
    rules=(
        Rule(
            "has(self.required) != has(self.preferred)",
            "give one of required or preferred",
            "",
            lambda t: ("required" in t) != ("preferred" in t),
        ),
    ),
)

MANAGED_BY = Field(
    "string",
    f"The controller that runs the job: {MANAGED_BY_PIPEJOB} (the default) or another, e.g."
    f" {MULTIKUEUE}, which runs it on a worker cluster; the operator then leaves the job,"
    " its status included, to it. Set it when the job is created.",
    pattern=r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?",
    pattern_says="be a domain-prefixed name such as kueue.x-k8s.io/multikueue",
    max_length=63,
)


def managed_elsewhere(job_obj: KubeObject) -> bool:
    """Whether the job's spec.managedBy names another controller than pipejob's operator."""
    owner = (job_obj.get("spec") or {}).get("managedBy")
    return owner is not None and owner != MANAGED_BY_PIPEJOB


def _not_in_template(key: str, why: str) -> Rule:
    return Rule(
        f"!has(self.scheduling) || !has(self.template) || !has(self.template.{key})",
        why,
        f"template.{key}",
        lambda s: "scheduling" not in s or key not in (s.get("template") or {}),
    )


# Cross-field rules on the spec: one place says who schedules the pods, and at what priority.
RULES = (
    Rule(
        "!has(self.scheduling) || self.scheduling.provider == 'kueue' || !has(self.template)"
        " || !has(self.template.schedulerName)",
        "volcano and coscheduling set the pods' scheduler: use spec.scheduling.schedulerName",
        "template.schedulerName",
        lambda s: (
            "scheduling" not in s
            or s["scheduling"]["provider"] == KUEUE
            or "schedulerName" not in (s.get("template") or {})
        ),
    ),
    Rule(
        "!has(self.topology) || (has(self.scheduling) && self.scheduling.provider == 'kueue')",
        "topology-aware scheduling is Kueue's: set spec.scheduling.provider kueue too",
        "topology",
        lambda s: "topology" not in s or (s.get("scheduling") or {}).get("provider") == KUEUE,
    ),
    _not_in_template(
        "priorityClassName",
        "with spec.scheduling, the priority class goes in spec.scheduling.priorityClassName",
    ),
)


@dataclass(frozen=True)
class Scheduling:
    """spec.scheduling as the operator reads it (the table above gives its meaning)."""

    provider: str  # KUEUE, VOLCANO or COSCHEDULING
    queue: str | None = None
    priority_class_name: str | None = None
    scheduler_name: str | None = None
    schedule_timeout_seconds: int | None = None
    # The Kueue TAS annotation of spec.topology, for every pod of the world; {}: none.
    topology_annotation: dict[str, str] = field(default_factory=dict)


class SchedulingJson(TypedDict, total=False):
    """spec.scheduling as the manifest writes it (defaulted)."""

    provider: str
    queue: str
    priorityClassName: str
    schedulerName: str
    scheduleTimeoutSeconds: int


def section(raw: SchedulingJson | None, topology: dict[str, str]) -> Scheduling | None:
    """spec.scheduling with spec.topology (which, level), or None when the default
    scheduler runs the pods."""
    if not raw:
        return None
    return Scheduling(
        raw["provider"],
        raw.get("queue"),
        raw.get("priorityClassName"),
        raw.get("schedulerName"),
        raw.get("scheduleTimeoutSeconds"),
        {
            TOPOLOGY_ANNOTATIONS[which]: level
            for which, level in topology.items()
            if which in TOPOLOGY_ANNOTATIONS
        },
    )
