"""The operator's one decision: from what is observed (the job object and its pods) to what
to do (status, pods to create or delete, events). Pure and level-based: it reads no memory
of earlier calls, so the operator can be restarted at any moment and converges again.

Each situation of a job's life is a function of situations.py, and `SITUATIONS` lists them in
the order they take precedence; docs/architecture.md tells the whole path."""

from __future__ import annotations

from datetime import datetime

from pipejob.core import scheduling as sch
from pipejob.core.contract import Progress
from pipejob.core.k8s import KubeObject
from pipejob.operator import kube, queueing
from pipejob.operator import status as st
from pipejob.operator.actions import NORMAL, WARNING, Actions, Event
from pipejob.operator.observation import Observed, owned
from pipejob.operator.policy_settings import DEFAULT, NetworkPolicySettings
from pipejob.operator.situations import SITUATIONS
from pipejob.operator.world_failures import CAUSE_GRACE

__all__ = ["CAUSE_GRACE", "NORMAL", "WARNING", "Actions", "Event", "decide", "owned"]


def decide(
    job_obj: KubeObject,
    pods: list[KubeObject],
    now: datetime,
    image: str,
    progress: Progress | None = None,
    allow_node_volumes: bool = False,
    policy: NetworkPolicySettings | None = DEFAULT,
) -> Actions:
    """What to do about `job_obj` given `pods` (every pod labelled with its name) and, when
    the caller polled it, the `progress` its current world's master reported;
    without one the last reported figures stay. `allow_node_volumes` is the operator's
    allowance of hostPath and other node-level volumes; `policy` its settings of the worlds'
    NetworkPolicies (None: none)."""
    seen = Observed(job_obj, pods, now, image, progress, allow_node_volumes, policy)
    acts = _decide(seen)
    scheduling = (job_obj.get("spec") or {}).get("scheduling")
    if isinstance(scheduling, dict) and scheduling.get("provider") == sch.KUEUE:
        uid, world = job_obj["metadata"].get("uid"), st.world_number(acts.status)
        current = [p for p in pods if owned(p, uid) and kube.restart_of(p) == world]
        keep, ending = queueing.end_kueue_group(acts.status, current, now)
        acts.end_group += ending
        if keep:
            acts.delete = []  # they are leaving rpc.shutdown: stopping them fails the group
    return acts


def _decide(seen: Observed) -> Actions:
    """The actions of the first situation, in SITUATIONS' order, that the job is in (the last
    one, starting or running, always answers)."""
    for situation in SITUATIONS:
        acts = situation(seen)
        if acts is not None:
            return acts
    raise AssertionError("no situation answered")  # starting_or_running always does
