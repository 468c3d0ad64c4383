"""A job's phase and conditions: their names, and how a status moves between them."""

from __future__ import annotations

from datetime import UTC, datetime

from pipejob.operator.status.job_status import JobCondition, JobStatus

PENDING = "Pending"
QUEUED = "Queued"  # every pod exists; a gang scheduler has not admitted the world yet
RUNNING = "Running"
RESTARTING = "Restarting"
SUSPENDED = "Suspended"
SUCCEEDED = "Succeeded"
FAILED = "Failed"

PHASES = (PENDING, QUEUED, RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED)
FINISHED = (SUCCEEDED, FAILED)

# Conditions: one per phase but Pending (a job is pending until told otherwise), plus
# Created, which says whether every pod of the current world has been created, and
# Preflight, the outcome of the world's communication check before training.
CREATED = "Created"
PREFLIGHT = "Preflight"
RESIZED = "Resized"  # an elastic world's last change of size, and why
PHASE_CONDITIONS = (QUEUED, RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED)
CONDITIONS = (CREATED, *PHASE_CONDITIONS, PREFLIGHT, RESIZED)


def timestamp(t: datetime) -> str:
    """RFC 3339 in UTC, to the second, as Kubernetes writes times."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str | None) -> datetime | None:
    if not s:
        return None
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


def world_number(status: JobStatus) -> int:
    """The number of the job's current world: every restart, failed, preempted or resized,
    makes one, and so does one after an OOM kill."""
    counts = ("restarts", "preemptions", "resizes", "oomKills")
    return sum(int(status.get(count) or 0) for count in counts)


def condition(status: JobStatus, kind: str) -> JobCondition | None:
    for c in status.get("conditions") or []:
        if c.get("type") == kind:
            return c
    return None


def is_true(status: JobStatus, kind: str) -> bool:
    c = condition(status, kind)
    return c is not None and c.get("status") == "True"


def set_condition(
    conditions: list[JobCondition],
    kind: str,
    true: bool,
    reason: str,
    message: str,
    now: datetime,
) -> list[JobCondition]:
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


def with_phase(
    status: JobStatus, phase: str, reason: str, message: str, now: datetime
) -> JobStatus:
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
