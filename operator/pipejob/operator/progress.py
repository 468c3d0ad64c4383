"""Live progress of a running job: the operator reads the master pod's /progress over HTTP.

Pods get no Kubernetes API rights for this: the master serves its figures on the monitor
port (trainer/monitor.py), the operator polls them with a short timeout and writes them into
the job's status. Every failure to fetch or understand a report is "no report this time"."""

from __future__ import annotations

import json
import logging
import math
import urllib.request
from typing import Any

from pipejob.operator import kube
from pipejob.operator import status as st

TIMEOUT = 1.0  # seconds; a slow or gone master must not hold its job's reconcile for long
MAX_BYTES = 64 * 1024  # a report is a few hundred bytes

log = logging.getLogger("pipejob.operator")
# Straight to the pod: a proxy configured for the operator's other traffic has no route to it.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def url(pods: list[dict], restart: int) -> str | None:
    """The /progress URL of the running master of world `restart`, or None if there is none."""
    for pod in pods:
        if (
            kube.role_of(pod) == "master"
            and kube.restart_of(pod) == restart
            and st.pod_phase(pod) == "Running"
            and not st.deleting(pod)
        ):
            ip = (pod.get("status") or {}).get("podIP")
            if ip:
                host = f"[{ip}]" if ":" in ip else ip
                return f"http://{host}:{kube.PORTS.monitor}/progress"
    return None


def fetch(address: str, timeout: float = TIMEOUT) -> dict | None:
    """GET `address` and parse the report; None when unreachable, slow or not a report."""
    try:
        with _opener.open(address, timeout=timeout) as response:
            body = response.read(MAX_BYTES + 1)
    except (OSError, ValueError) as e:  # refused, timed out, reset, HTTP error, bad URL
        log.debug(f"no progress from {address}: {e}")
        return None
    if len(body) > MAX_BYTES:
        log.debug(f"no progress from {address}: the report is over {MAX_BYTES} bytes")
        return None
    try:
        return parse(json.loads(body))
    except (ValueError, UnicodeDecodeError) as e:
        log.debug(f"no progress from {address}: {e}")
        return None


def parse(data: Any) -> dict:
    """The fields of a /progress report the status shows, checked: a report that says
    something other than the trainer's JSON (see CONTEXT: GET /progress) raises ValueError;
    an unknown phase or a figure of the wrong type counts as absent."""
    if not isinstance(data, dict):
        raise ValueError(f"a report is a JSON object, got {type(data).__name__}")
    step, steps = data.get("step"), data.get("steps")
    if not _count(step) or not _count(steps):
        raise ValueError(f"a report has whole numbers step and steps, got {step!r}, {steps!r}")
    report: dict[str, Any] = {"step": step, "steps": steps}
    if data.get("phase") in st.TRAINER_PHASES:
        report["phase"] = data["phase"]
    for key in ("loss", "samplesPerSecond", "bubble"):
        value = data.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            report[key] = float(value)
    if _count(data.get("resumedFromStep")):
        report["resumedFromStep"] = data["resumedFromStep"]
    if isinstance(data.get("message"), str) and data["message"]:
        report["message"] = data["message"][: st.MAX_MESSAGE]
    preflight = data.get("preflight")
    if isinstance(preflight, dict) and isinstance(preflight.get("ok"), bool):
        message = preflight.get("message")
        report["preflight"] = {
            "ok": preflight["ok"],
            "message": message[: st.MAX_MESSAGE] if isinstance(message, str) else "",
        }
    return report


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
