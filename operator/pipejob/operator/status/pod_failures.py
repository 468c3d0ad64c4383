"""Why one pod of a world failed, in words: it failed (permanently, or for losing a peer), was
evicted, preempted or disrupted, or its image cannot run the trainer (which of a world's
failures broke it: world_failures.py)."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from pipejob.core.contract import BROKEN_PREFIX, STALLED_PREFIX, ExitCode, parse_permanent
from pipejob.core.k8s import KubeObject
from pipejob.operator.status.pods import pod_phase, tail, trainer_state

# Exit codes of failures a restart would repeat: the job fails at once.
PERMANENT_CODES = (ExitCode.BAD_ENVIRONMENT, ExitCode.PERMANENT)


@dataclass(frozen=True)
class Failure:
    """Why a world broke, in words: the condition reason and message."""

    reason: str  # PodFailed | PodEvicted | PodDeleted | Stalled | ImagePullFailed | ...
    message: str
    at: str = ""  # when the container finished (RFC 3339), to find the first failure
    # It failed only because the world broke under it (its message starts with
    # BROKEN_PREFIX): another pod's failure is the cause, whatever finished first.
    consequence: bool = False


# Kueue's older releases name the condition TerminationTarget.
DISRUPTION_CONDITIONS = ("DisruptionTarget", "TerminationTarget")


def disruption(pod: KubeObject, process: str) -> Failure | None:
    """The preemption, eviction or disruption of a pod (its DisruptionTarget condition, set by
    the scheduler, the kubelet, the eviction API, the taint manager or Kueue), else None."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") in DISRUPTION_CONDITIONS and c.get("status") == "True":
            why = ": ".join(filter(None, (c.get("reason"), c.get("message"))))
            name = pod["metadata"]["name"]
            return Failure(
                "Preempted", f"{process} (pod {name}) was preempted ({why or 'disrupted'})"
            )
    return None


def pod_failure(pod: KubeObject, process: str) -> Failure | None:
    """The failure of a Failed pod (`process` names its process, e.g. "stage 1"), else None."""
    if pod_phase(pod) != "Failed":
        return None
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    if status.get("reason") == "Evicted":
        return Failure("PodEvicted", f"{process} (pod {name}) was evicted: {status.get('message')}")
    state = trainer_state(pod)
    code = state.get("exitCode")
    termination = (state.get("message") or "").strip()
    if code == ExitCode.STALLED and termination.startswith(
        STALLED_PREFIX
    ):  # its watchdog named one
        stalled = termination.removeprefix(STALLED_PREFIX).strip()
        return Failure(
            "Stalled",
            f"{tail(stalled)} (found by {process}, pod {name})",
            state.get("finishedAt") or "",
        )
    message = f"{process} (pod {name}) failed with exit code {code if code is not None else '?'}"
    killed = _signal_name(code)
    if state.get("reason") or killed:
        message += f" ({', '.join(filter(None, (state.get('reason'), killed)))})"
    detail = (state.get("message") or status.get("message") or "").strip()
    if detail and not killed:  # a killed process's last lines are not its error
        message += ": " + tail(detail)
    return Failure(
        "PodFailed",
        message,
        state.get("finishedAt") or "",
        consequence=termination.startswith(BROKEN_PREFIX),
    )


# A permanent verdict is one line the trainer wrote for the status, not a log tail: its start
# names the field and its end the line it came from, so it is kept whole up to this (an
# Event's message holds 1024 bytes; the pod's name and exit code come before it).
VERDICT_CHARS = 900


def permanent_failure(pod: KubeObject, process: str) -> Failure | None:
    """A Failed pod's failure if the trainer said a restart cannot cure it (its exit code
    and termination message, core/contract.py), else None. The reason is the trainer's."""
    state = trainer_state(pod)
    if pod_phase(pod) != "Failed" or state.get("exitCode") not in PERMANENT_CODES:
        return None
    parsed = parse_permanent((state.get("message") or "").strip())
    reason, detail = parsed or ("PermanentFailure", (state.get("message") or "").strip())
    name = pod["metadata"]["name"]
    message = f"{process} (pod {name}) failed permanently with exit code {state['exitCode']}"
    return Failure(
        reason,
        message + (": " + tail(detail, VERDICT_CHARS) if detail else ""),
        state.get("finishedAt") or "",
    )


# Waiting reasons no wait cures: the image cannot be had. The job fails at once, naming the
# image, instead of waiting forever (a registry outage fails it too: resubmit the job).
IMAGE_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
# What `python -m pipejob.trainer` says in an image without pipejob.
NO_PIPEJOB = re.compile(r"No module named '?pipejob(\.\w+)*'?(\W|$)")
FROM_TRAINER = "use the trainer image, or an image built FROM it, in spec.template.image"


def image_failure(pod: KubeObject, process: str) -> Failure | None:
    """The pod's image cannot be pulled, or has no pipejob: no restart can help."""
    image = pod["spec"]["containers"][0].get("image")
    name = pod["metadata"]["name"]
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_FAILURES:
            pulling = ": ".join(filter(None, (waiting["reason"], waiting.get("message"))))
            why = f"image {image!r} cannot be pulled ({tail(pulling)}); {FROM_TRAINER}"
            return Failure("ImagePullFailed", f"{process} (pod {name}) cannot start: {why}")
    state = trainer_state(pod)
    if pod_phase(pod) == "Failed" and NO_PIPEJOB.search(state.get("message") or ""):
        why = f"image {image!r} cannot import pipejob; {FROM_TRAINER}"
        return Failure(
            "ImageLacksPipejob", f"{process} (pod {name}): {why}", state.get("finishedAt") or ""
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
