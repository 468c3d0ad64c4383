"""`spec.scheduling`: gang admission of a job's world by Kueue, Volcano or the coscheduling
plugin, so a world starts whole or not at all. Only the operator reads it (`pipejob run`
ignores it); this module holds its table, its rules and the names each scheduler reads."""

from __future__ import annotations

from typing import Any

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
    _not_in_template(
        "priorityClassName",
        "with spec.scheduling, the priority class goes in spec.scheduling.priorityClassName",
    ),
)


def section(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The spec's scheduling section, or None when the default scheduler runs the pods."""
    return spec.get("scheduling") or None
