"""The registry of job kinds: every kind pipejob serves, each declared once in its module."""

from __future__ import annotations

from pipejob.core.kind import Kind
from pipejob.core.kinds.hybrid import HYBRID_JOB
from pipejob.core.kinds.pipeline import PIPELINE_JOB

KINDS: dict[str, Kind] = {k.name: k for k in (PIPELINE_JOB, HYBRID_JOB)}


def get(name: str) -> Kind:
    return KINDS[name]


def by_plural(plural: str) -> Kind | None:
    return next((k for k in KINDS.values() if k.plural == plural), None)
