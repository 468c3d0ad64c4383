"""A job's status: its schema, and pure helpers that read pods and write phase and conditions.

Nothing here talks to Kubernetes; everything takes and returns plain dicts."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pipejob.schema import Field

PENDING = "Pending"
RUNNING = "Running"
RESTARTING = "Restarting"
SUSPENDED = "Suspended"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
PHASES = (PENDING, RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED)
FINISHED = (SUCCEEDED, FAILED)

# Conditions: one per phase but Pending (a job is pending until told otherwise), plus
# Created, which says whether every pod of the current world has been created.
CREATED = "Created"
PHASE_CONDITIONS = (RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED)
CONDITIONS = (CREATED, *PHASE_CONDITIONS)

# A terminated container's message (its log tail, see kube.py) is cut to this in reasons.
MAX_MESSAGE = 300

_COUNT = Field("integer", "Pods in this state.", minimum=0)

STATUS = Field(
    "object",
    "What the operator observed: the job's phase, its pods per role, restarts and history.",
    fields={
        "phase": Field(
            "string",
            "Pending, Running, Restarting, Suspended, Succeeded or Failed.",
            enum=PHASES,
        ),
        "observedGeneration": Field(
            "integer", "The metadata.generation of the spec this status describes.", minimum=0
        ),
        "restarts": Field(
            "integer",
            "Whole-world restarts so far; pods carry it as the pipejob.dev/restart label.",
            minimum=0,
        ),
        "startTime": Field("string", "When the operator started the job (RFC 3339)."),
        "completionTime": Field("string", "When the job succeeded or failed (RFC 3339)."),
        "roles": Field(
            "object",
            "Pods of the current world per role (master, stage, ps, trainer), by pod phase.",
            values=Field(
                "object",
                "Pod counts of one role.",
                fields={
                    "pending": _COUNT,
                    "running": _COUNT,
                    "succeeded": _COUNT,
                    "failed": _COUNT,
                },
            ),
        ),
        "conditions": Field(
            "array",
            "Created, Running, Restarting, Suspended, Succeeded and Failed, each with why.",
            items=Field(
                "object",
                "One condition of the job.",
                fields={
                    "type": Field("string", "The condition.", enum=CONDITIONS),
                    "status": Field(
                        "string", "Whether it holds.", enum=("True", "False", "Unknown")
                    ),
                    "reason": Field("string", "One CamelCase word saying why."),
                    "message": Field("string", "A sentence saying why."),
                    "lastTransitionTime": Field("string", "When status last changed (RFC 3339)."),
                },
                required=("type", "status"),
            ),
        ),
        "progress": Field(
            "string", "Training progress reported by the master, as step/steps (e.g. 7/10)."
        ),
        "training": Field(
            "object",
            "Live training figures reported by the master (step, loss, samples/s, ...).",
            free_form=True,
            fields={
                "step": Field("integer", "Last finished step.", minimum=0),
                "steps": Field("integer", "Steps the job runs in total.", minimum=0),
                "loss": Field("number", "Loss of the last finished step."),
                "samplesPerSecond": Field("number", "Training throughput."),
                "updateTime": Field("string", "When these figures were reported (RFC 3339)."),
            },
        ),
    },
)


def timestamp(t: datetime) -> str:
    """RFC 3339 in UTC, to the second, as Kubernetes writes times."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str | None) -> datetime | None:
    if not s:
        return None
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


# --- pods -------------------------------------------------------------------------------


def pod_phase(pod: dict) -> str:
    return (pod.get("status") or {}).get("phase") or "Pending"


def deleting(pod: dict) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def terminated(pod: dict) -> bool:
    return pod_phase(pod) in ("Succeeded", "Failed")


def role_counts(pods: Iterable[dict], role_of: Any) -> dict[str, dict[str, int]]:
    """{role: {pending, running, succeeded, failed}} over `pods`."""
    counts: dict[str, dict[str, int]] = {}
    for pod in pods:
        phase = pod_phase(pod).lower()
        row = counts.setdefault(
            role_of(pod), {"pending": 0, "running": 0, "succeeded": 0, "failed": 0}
        )
        row[phase if phase in row else "pending"] += 1
    return counts


@dataclass(frozen=True)
class Failure:
    """Why a world broke, in words: the condition reason and message."""

    reason: str  # PodFailed | PodEvicted | PodDeleted
    message: str
    at: str = ""  # when the container finished (RFC 3339), to find the first failure


def _trainer_state(pod: dict) -> dict:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated_state = (cs.get("state") or {}).get("terminated")
        if terminated_state:
            return terminated_state
    return {}


def pod_failure(pod: dict, who: str) -> Failure | None:
    """The failure of a Failed pod (`who` names its role, e.g. "stage 1"), else None."""
    if pod_phase(pod) != "Failed":
        return None
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    if status.get("reason") == "Evicted":
        return Failure("PodEvicted", f"{who} (pod {name}) was evicted: {status.get('message')}")
    state = _trainer_state(pod)
    code = state.get("exitCode")
    message = f"{who} (pod {name}) failed with exit code {code if code is not None else '?'}"
    if state.get("reason"):
        message += f" ({state['reason']})"
    detail = (state.get("message") or status.get("message") or "").strip()
    if detail:
        message += ": " + _tail(detail)
    return Failure("PodFailed", message, state.get("finishedAt") or "")


def _tail(text: str) -> str:
    """The end of a log tail is where the error is."""
    return text if len(text) <= MAX_MESSAGE else "..." + text[-MAX_MESSAGE:]


# --- conditions -------------------------------------------------------------------------


def condition(status: dict, kind: str) -> dict | None:
    for c in status.get("conditions") or []:
        if c.get("type") == kind:
            return c
    return None


def is_true(status: dict, kind: str) -> bool:
    c = condition(status, kind)
    return c is not None and c.get("status") == "True"


def set_condition(
    conditions: list[dict], kind: str, true: bool, reason: str, message: str, now: datetime
) -> list[dict]:
    """`conditions` with `kind` set; lastTransitionTime moves only when the status flips."""
    value = "True" if true else "False"
    out, found = [], False
    for c in conditions:
        if c.get("type") == kind:
            found = True
            moved = c.get("status") != value
            c = {
                "type": kind,
                "status": value,
                "reason": reason,
                "message": message,
                "lastTransitionTime": timestamp(now) if moved else c.get("lastTransitionTime"),
            }
        out.append(c)
    if not found:
        out.append(
            {
                "type": kind,
                "status": value,
                "reason": reason,
                "message": message,
                "lastTransitionTime": timestamp(now),
            }
        )
    return out


def with_phase(status: dict, phase: str, reason: str, message: str, now: datetime) -> dict:
    """`status` in `phase`: its condition True with the reason; other phase conditions False."""
    conditions = list(status.get("conditions") or [])
    for kind in PHASE_CONDITIONS:
        if kind == phase:
            conditions = set_condition(conditions, kind, True, reason, message, now)
        else:
            old = next((c for c in conditions if c.get("type") == kind), None)
            if old is not None and old.get("status") == "True":
                conditions = set_condition(
                    conditions, kind, False, reason, f"now {phase}: {message}", now
                )
    out = dict(status, phase=phase, conditions=conditions)
    if phase in FINISHED and not status.get("completionTime"):
        out["completionTime"] = timestamp(now)
    return out
