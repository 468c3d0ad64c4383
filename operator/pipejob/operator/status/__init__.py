"""A job's status: its schema, and pure helpers that read pods and write phase and conditions.

Nothing here talks to Kubernetes; everything takes and returns plain dicts. One module per
job: conditions.py (phases and conditions), fields.py (the status's schema), pods.py (what a
pod says), failures.py (why a world broke), training.py (the master's figures). Callers use
the names below, whichever module holds them."""

from pipejob.operator.status.conditions import (
    CONDITIONS,
    CREATED,
    FAILED,
    FINISHED,
    PENDING,
    PHASE_CONDITIONS,
    PHASES,
    PREFLIGHT,
    QUEUED,
    RESIZED,
    RESTARTING,
    RUNNING,
    SUCCEEDED,
    SUSPENDED,
    condition,
    is_true,
    parse_time,
    set_condition,
    timestamp,
    with_phase,
    world,
)
from pipejob.operator.status.failures import (
    DISRUPTION_CONDITIONS,
    FROM_TRAINER,
    IMAGE_FAILURES,
    NO_PIPEJOB,
    PERMANENT_CODES,
    Failure,
    disruption,
    image_failure,
    permanent_failure,
    pod_failure,
)
from pipejob.operator.status.fields import STATUS
from pipejob.operator.status.pods import (
    deleting,
    pod_phase,
    role_counts,
    scheduled_message,
    tail,
    terminated,
    trainer_state,
    waiting_message,
)
from pipejob.operator.status.training import (
    preflight_failure,
    with_preflight,
    with_report,
    with_training,
)

__all__ = [
    "CONDITIONS", "CREATED", "DISRUPTION_CONDITIONS", "FAILED", "FINISHED", "FROM_TRAINER",
    "IMAGE_FAILURES", "NO_PIPEJOB", "PENDING", "PERMANENT_CODES", "PHASES", "PHASE_CONDITIONS",
    "PREFLIGHT", "QUEUED", "RESIZED", "RESTARTING", "RUNNING", "STATUS", "SUCCEEDED", "SUSPENDED",
    "Failure", "condition", "deleting", "disruption", "image_failure", "is_true", "parse_time",
    "permanent_failure", "pod_failure", "pod_phase", "preflight_failure", "role_counts",
    "scheduled_message", "set_condition", "tail", "terminated", "timestamp", "trainer_state",
    "waiting_message", "with_phase", "with_preflight", "with_report", "with_training", "world",
]  # fmt: skip
