"""A job's status: its schema, and pure helpers that read pods and write phase and conditions.

Nothing here talks to Kubernetes; everything takes and returns plain dicts. Over 400 lines
because the status's schema (the CRD's table of fields) sits beside the helpers that read
pods (why a world broke) and write phases and conditions from them."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pipejob.core.contract import (
    BROKEN_PREFIX,
    MAX_MESSAGE,
    PREFLIGHT_PREFIX,
    STALLED_PREFIX,
    ExitCode,
    Progress,
    parse_permanent,
)  # fmt: skip
from pipejob.core.schema import Field

PENDING = "Pending"
QUEUED = "Queued"  # every pod exists; a gang scheduler has not admitted the world yet
RUNNING = "Running"
RESTARTING = "Restarting"
SUSPENDED = "Suspended"
SUCCEEDED = "Succeeded"
FAILED = "Failed"

# Exit codes of failures a restart would repeat: the job fails at once.
PERMANENT_CODES = (ExitCode.BAD_ENVIRONMENT, ExitCode.PERMANENT)

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


_COUNT = Field("integer", "Pods in this state.", minimum=0)

STATUS = Field(
    "object",
    "What the operator observed: the job's phase, its pods per role, restarts and history.",
    fields={
        "phase": Field(
            "string",
            "Pending, Queued, Running, Restarting, Suspended, Succeeded or Failed.",
            enum=PHASES,
        ),
        "observedGeneration": Field(
            "integer", "The metadata.generation of the spec this status describes.", minimum=0
        ),
        "restarts": Field(
            "integer",
            "Whole-world restarts after failures so far (each spends backoffLimit).",
            minimum=0,
        ),
        "preemptions": Field(
            "integer",
            "Whole-world restarts after a pod was preempted, evicted or disrupted (its"
            " DisruptionTarget condition); they spend no backoffLimit. Pods carry"
            " restarts + preemptions, the world's number, as the pipejob.dev/restart label.",
            minimum=0,
        ),
        "startTime": Field("string", "When the operator started the job (RFC 3339)."),
        "completionTime": Field("string", "When the job succeeded or failed (RFC 3339)."),
        "resizes": Field(
            "integer",
            "Whole-world restarts at another size (an elastic replicas or trainers); they"
            " spend no backoffLimit and count in the world's number.",
            minimum=0,
        ),
        "replicas": Field(
            "integer", "PipelineJob: copies of the pipeline the current world runs.", minimum=0
        ),
        "trainers": Field("integer", "HybridJob: trainers the current world runs.", minimum=0),
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
            "Created, Queued, Running, Restarting, Suspended, Succeeded, Failed, Preflight"
            " and Resized, each with why.",
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
            "Live training figures, polled from the master's /progress while the job runs.",
            free_form=True,
            fields={
                "phase": Field(
                    "string",
                    "What the master is doing: starting, preflight, training, finished or failed.",
                ),
                "step": Field("integer", "Last finished step.", minimum=0),
                "steps": Field("integer", "Steps the job runs in total.", minimum=0),
                "loss": Field("number", "Loss of the last finished step."),
                "samplesPerSecond": Field("number", "Training throughput."),
                "bubble": Field(
                    "number",
                    "PipelineJob: measured share of time the stages sat idle.",
                ),
                "learningRate": Field(
                    "number", "Learning rate of the last optimizer step (optimizer.schedule)."
                ),
                "gradNorm": Field(
                    "number",
                    "Global L2 norm of the last step's gradients over every stage and replica,"
                    " before clipping (optimizer.clipGradNorm).",
                ),
                "resumedFromStep": Field(
                    "integer", "The checkpoint step the current world resumed from.", minimum=0
                ),
                "checkpointStep": Field(
                    "integer",
                    "The step of the newest checkpoint the current world wrote.",
                    minimum=0,
                ),
                "checkpointTime": Field("string", "When it was written (RFC 3339)."),
                "message": Field("string", "The master's last word on its state."),
                "evalStep": Field(
                    "integer",
                    "The step of the last evaluation on held-out data (spec.eval).",
                    minimum=0,
                ),
                "evalLoss": Field("number", "Loss on the held-out data at the last evaluation."),
                "evalAccuracy": Field(
                    "number", "Held-out accuracy (0 to 1) at the last evaluation (classification)."
                ),
                "evalPerplexity": Field(
                    "number",
                    "Perplexity (exp of the per-token loss) on the held-out tokens at the last"
                    " evaluation (the language model).",
                ),
                "memory": Field(
                    "object",
                    "Peak memory of each member of the world so far (by RPC name: master,"
                    " stage0, ps, trainer1, ...), measured at each logged step and at the end,"
                    " so the tight one shows.",
                    values=Field(
                        "object",
                        "One member's peaks, in bytes.",
                        fields={
                            "rssPeakBytes": Field(
                                "integer",
                                "Peak resident memory (VmHWM), what a memory limit counts.",
                                minimum=0,
                            ),
                            "cudaPeakBytes": Field(
                                "integer",
                                "Peak GPU memory torch allocated (a member on a GPU).",
                                minimum=0,
                            ),
                        },
                    ),
                ),
                "updateTime": Field("string", "When these figures last changed (RFC 3339)."),
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


def world(status: dict) -> int:
    """The number of the job's current world: every restart, failed, preempted or resized,
    makes one."""
    counts = ("restarts", "preemptions", "resizes")
    return sum(int(status.get(count) or 0) for count in counts)


# Kueue's older releases name the condition TerminationTarget.
DISRUPTION_CONDITIONS = ("DisruptionTarget", "TerminationTarget")


def disruption(pod: dict, who: str) -> Failure | None:
    """The preemption, eviction or disruption of a pod (its DisruptionTarget condition, set by
    the scheduler, the kubelet, the eviction API, the taint manager or Kueue), else None."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") in DISRUPTION_CONDITIONS and c.get("status") == "True":
            why = ": ".join(filter(None, (c.get("reason"), c.get("message"))))
            name = pod["metadata"]["name"]
            return Failure("Preempted", f"{who} (pod {name}) was preempted ({why or 'disrupted'})")
    return None


def scheduled_message(pod: dict) -> str:
    """What the scheduler said about a pod it has not placed (its PodScheduled condition)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return ": ".join(filter(None, (c.get("reason"), c.get("message"))))
    return ""


def waiting_message(pod: dict) -> str:
    """Why a pod's container has not started (its waiting state: ErrImagePull,
    ImagePullBackOff, CreateContainerConfigError, ...), or "" when it is only being made."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
            return _tail(": ".join(filter(None, (waiting.get("reason"), waiting.get("message")))))
    return ""


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

    reason: str  # PodFailed | PodEvicted | PodDeleted | Stalled | ImagePullFailed | ...
    message: str
    at: str = ""  # when the container finished (RFC 3339), to find the first failure
    # It failed only because the world broke under it (its message starts with
    # BROKEN_PREFIX): another pod's failure is the cause, whatever finished first.
    consequence: bool = False


def trainer_state(pod: dict) -> dict:
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
    state = trainer_state(pod)
    code = state.get("exitCode")
    said = (state.get("message") or "").strip()
    if code == ExitCode.STALLED and said.startswith(STALLED_PREFIX):  # its watchdog named one
        stalled = said.removeprefix(STALLED_PREFIX).strip()
        return Failure("Stalled", f"{_tail(stalled)} (found by {who}, pod {name})",
                       state.get("finishedAt") or "")  # fmt: skip
    message = f"{who} (pod {name}) failed with exit code {code if code is not None else '?'}"
    killed = _signal_name(code)
    if state.get("reason") or killed:
        message += f" ({', '.join(filter(None, (state.get('reason'), killed)))})"
    detail = (state.get("message") or status.get("message") or "").strip()
    if detail and not killed:  # a killed process's last lines are not its error
        message += ": " + _tail(detail)
    return Failure("PodFailed", message, state.get("finishedAt") or "",
                   consequence=said.startswith(BROKEN_PREFIX))  # fmt: skip


def permanent_failure(pod: dict, who: str) -> Failure | None:
    """A Failed pod's failure if the trainer said a restart cannot cure it (its exit code
    and termination message, core/contract.py), else None. The reason is the trainer's."""
    state = trainer_state(pod)
    if pod_phase(pod) != "Failed" or state.get("exitCode") not in PERMANENT_CODES:
        return None
    parsed = parse_permanent((state.get("message") or "").strip())
    reason, detail = parsed or ("PermanentFailure", (state.get("message") or "").strip())
    name = pod["metadata"]["name"]
    message = f"{who} (pod {name}) failed permanently with exit code {state['exitCode']}"
    return Failure(reason, message + (": " + _tail(detail) if detail else ""),
                   state.get("finishedAt") or "")  # fmt: skip


# Waiting reasons no wait cures: the image cannot be had. The job fails at once, naming the
# image, instead of waiting forever (a registry outage fails it too: resubmit the job).
IMAGE_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
# What `python -m pipejob.trainer` says in an image without pipejob.
NO_PIPEJOB = re.compile(r"No module named '?pipejob(\.\w+)*'?(\W|$)")
FROM_TRAINER = "use the trainer image, or an image built FROM it, in spec.template.image"


def image_failure(pod: dict, who: str) -> Failure | None:
    """The pod's image cannot be pulled, or has no pipejob: no restart can help."""
    image = pod["spec"]["containers"][0].get("image")
    name = pod["metadata"]["name"]
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_FAILURES:
            said = ": ".join(filter(None, (waiting["reason"], waiting.get("message"))))
            why = f"image {image!r} cannot be pulled ({_tail(said)}); {FROM_TRAINER}"
            return Failure("ImagePullFailed", f"{who} (pod {name}) cannot start: {why}")
    state = trainer_state(pod)
    if pod_phase(pod) == "Failed" and NO_PIPEJOB.search(state.get("message") or ""):
        why = f"image {image!r} cannot import pipejob; {FROM_TRAINER}"
        return Failure(
            "ImageLacksPipejob", f"{who} (pod {name}): {why}", state.get("finishedAt") or ""
        )
    return None


def _signal_name(code: int | None) -> str | None:
    """Exit codes above 128 are a signal's: 137 is "killed by SIGKILL"."""
    if code is None or not 128 < code < 128 + 65:
        return None
    try:
        return f"killed by {signal.Signals(code - 128).name}"
    except ValueError:
        return f"killed by signal {code - 128}"


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


def with_preflight(status: dict, ok: bool, message: str, now: datetime) -> dict:
    reason = "PreflightPassed" if ok else "PreflightFailed"
    conditions = set_condition(list(status.get("conditions") or []), PREFLIGHT, ok, reason,
                               message or reason, now)  # fmt: skip
    return dict(status, conditions=conditions)


# --- training progress -----------------------------------------------------------------


def with_training(status: dict, figures: dict, now: datetime) -> dict:
    """`status` showing `figures` (fields of contract.Progress but preflight; None means
    unknown): status.progress as step/steps for `kubectl get`, status.training with the rest;
    updateTime moves only when a figure does, so an unchanged report writes nothing."""
    training = {k: v for k, v in figures.items() if v is not None and k != "preflight"}
    old = status.get("training") or {}
    if training == {k: v for k, v in old.items() if k != "updateTime"}:
        training = old
    else:
        training["updateTime"] = timestamp(now)
    out = dict(status, training=training)
    if "step" in training and "steps" in training:
        out["progress"] = f"{training['step']}/{training['steps']}"
    return out


def with_report(status: dict, report: Progress, now: datetime) -> dict:
    """`status` with what the master's /progress reported."""
    out = with_training(status, report.figures(), now)
    if report.preflight is not None:
        out = with_preflight(out, report.preflight.ok, report.preflight.message, now)
    return out


def preflight_failure(pods: Iterable[dict]) -> str | None:
    """The termination message of the first failed pod whose preflight check failed."""
    for pod in pods:
        message = (trainer_state(pod).get("message") or "").strip()
        if pod_phase(pod) == "Failed" and message.startswith(PREFLIGHT_PREFIX):
            return _tail(message)
    return None


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
