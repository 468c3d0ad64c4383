"""The job's status as the operator writes and reads it: the shapes of status.* (fields.py
holds their schema, which the CRD and the API reference give). JSON the API server stores, so
TypedDicts: the keys are the format."""

from __future__ import annotations

from typing import TypedDict

from pipejob.core.contract import ReportedFigures


class JobCondition(TypedDict, total=False):
    """One of status.conditions: a condition type, whether it holds, and why."""

    type: str
    status: str  # True | False | Unknown
    reason: str
    message: str
    lastTransitionTime: str | None


class RoleCounts(TypedDict):
    """One role's pods of the current world by phase (status.roles[role])."""

    pending: int
    running: int
    succeeded: int
    failed: int


class TrainingStatus(ReportedFigures, total=False):
    """status.training: the master's last figures, and when they last changed."""

    updateTime: str


class JobStatus(TypedDict, total=False):
    """A PipelineJob's or HybridJob's status (fields.STATUS)."""

    phase: str
    observedGeneration: int
    restarts: int
    preemptions: int
    startTime: str
    completionTime: str
    resizes: int
    oomKills: int
    memory: dict[str, str]  # raised memory by role, a Kubernetes quantity
    replicas: int  # PipelineJob's elastic size
    trainers: int  # HybridJob's elastic size
    engine: str
    roles: dict[str, RoleCounts]
    conditions: list[JobCondition]
    progress: str  # step/steps
    training: TrainingStatus
