"""The master-first start, one idea for whoever runs a world: where a kind's master checks what
it can alone (Kind.checks_first: a PipelineJob's model against its data and loss), its master
starts first, told so by MASTER_FIRST, and the others once its /progress phase has left
`starting`. The local runner (runner/local.py) starts processes so; the operator
(operator/master_check.py) creates pods so, unless a gang scheduler needs every member at
once. A refusal then comes before any other member exists."""

from __future__ import annotations

import dataclasses

from pipejob.core import contract as c
from pipejob.core.plan import Process
from pipejob.core.spec import Job

# MASTER_FIRST's values: how the others come once the master has checked.
PROCESSES = "1"  # started at once as processes beside it (`pipejob run`)
# Created as pods (the operator): they may still be scheduled and pull their image, so the
# master's wait for them also allows rendezvousTimeoutSeconds.
PODS = "pods"
VALUES = (PROCESSES, PODS)

# The master's phases once its own check passed (`failed` is not one: it may have refused).
_CHECKED = ("preflight", "training", "finished")


def on_cluster(job: Job) -> bool:
    """Whether the operator starts `job`'s master first: its kind checks first and no gang
    scheduler (spec.scheduling) needs every member of the world at once."""
    return job.definition.checks_first and job.control.scheduling is None


def told(processes: list[Process], how: str) -> list[Process]:
    """`processes` with MASTER_FIRST set to `how` (PROCESSES or PODS), as every member gets it."""
    return [dataclasses.replace(p, env=p.env | {c.MASTER_FIRST: how}) for p in processes]


def checked(phase: str | None) -> bool:
    """Whether a master in this /progress phase has passed its own check: the others may come."""
    return phase in _CHECKED
