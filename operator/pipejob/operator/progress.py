"""Live progress of a running job: the operator reads the master pod's /progress over HTTP.

Pods get no Kubernetes API rights for this: the master serves its figures on the monitor
port (trainer/monitor.py), the operator polls them with a short timeout and writes them into
the job's status. Every failure to fetch or understand a report is "no report this time"."""

from __future__ import annotations

import json
import logging
import urllib.request

from pipejob.core.contract import Progress, ReportedFigures
from pipejob.core.k8s import KubeObject
from pipejob.operator import kube
from pipejob.operator import status as st

TIMEOUT = 1.0  # seconds; a slow or gone master must not hold its job's reconcile for long
MAX_BYTES = 64 * 1024  # a report is a few hundred bytes

log = logging.getLogger("pipejob.operator")
# Straight to the pod: a proxy configured for the operator's other traffic has no route to it.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def url(pods: list[KubeObject], restart: int) -> str | None:
    """The /progress URL of the running master of world `restart`, or None if there is none."""
    master = master_of(pods, restart)
    return None if master is None else address_of(master)


def master_of(pods: list[KubeObject], restart: int) -> KubeObject | None:
    """The running master of world `restart` with a podIP, or None if there is none."""
    for pod in pods:
        if (
            kube.role_of(pod) == "master"
            and kube.restart_of(pod) == restart
            and st.pod_phase(pod) == "Running"
            and not st.deleting(pod)
            and (pod.get("status") or {}).get("podIP")
        ):
            return pod
    return None


def address_of(master: KubeObject) -> str:
    """The /progress URL of a master pod that has a podIP."""
    ip = master["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{kube.PORTS.monitor}/progress"


def alone(pods: list[KubeObject], restart: int) -> bool:
    """Whether world `restart`'s master is its only live pod: where the others wait for its
    own check (operator/master_check.py), its polls gate them (poll_schedule.py)."""
    live = [p for p in pods if kube.restart_of(p) == restart and not st.deleting(p)]
    return all(kube.role_of(p) == "master" for p in live)


def digest(report: Progress) -> int:
    """A digest of everything of `report` the job's status shows (its figures and preflight):
    equal digests, nothing to write."""
    return hash(json.dumps(report.to_json(), sort_keys=True))


def fetch(address: str, timeout: float = TIMEOUT) -> Progress | None:
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
        return Progress.parse(json.loads(body))
    except (ValueError, UnicodeDecodeError) as e:
        log.debug(f"no progress from {address}: {e}")
        return None


def final_report(pod: KubeObject) -> ReportedFigures:
    """The figures of a master that exited 0: it leaves its last /progress report as its
    termination message (the operator's last poll may have come before the final
    evaluation). Empty if there is none, or it is not a report."""
    try:
        return Progress.parse(json.loads(st.trainer_state(pod).get("message") or "")).figures()
    except ValueError:
        return {}
