"""`spec.oom`: how the operator answers a member killed for memory (OOMKilled): a new world
with that role's memory raised, up to a cap. Only the operator reads it (`pipejob run`
ignores it); this module holds its table and the arithmetic of raised memory."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import TypedDict

from pipejob.core.k8s import KubeObject, quantity
from pipejob.core.schema import Field

INCREASE = 1.5  # spec.oom.increase when left out
# Without spec.oom.maxMemory, a role's memory grows to at most this many times its template's.
DEFAULT_CAP = 4
MEMORY = "memory"
_MI = 2**20

OOM = Field(
    "object",
    "What a member killed for memory (its container OOMKilled) brings: the whole world"
    " restarts with that role's memory request and limit raised, spending no backoffLimit,"
    " until the cap; at the cap the job fails naming the role and the memory it needed."
    " Ignored by `pipejob run`.",
    fields={
        "increase": Field(
            "number",
            "The factor a role's memory grows by at each OOM kill; 1 makes an OOM kill an"
            " ordinary failure (it spends backoffLimit).",
            default=INCREASE,
            minimum=1,
            maximum=16,
        ),
        "maxMemory": Field(
            "string",
            "The most memory a role's pods may be given (a Kubernetes quantity, e.g. 64Gi);"
            f" default: {DEFAULT_CAP}x the template's memory limit (or request).",
            pattern=r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?",
            pattern_says="be a memory quantity such as 64Gi, 512Mi or 1000000000",
            max_length=32,
        ),
    },
)


class OomJson(TypedDict, total=False):
    """spec.oom as the manifest writes it (defaulted)."""

    increase: float
    maxMemory: str


def template_memory(template: KubeObject) -> Decimal | None:
    """The memory a pod template gives every pod: its limit, else its request; None: none."""
    resources = template.get("resources") or {}
    for key in ("limits", "requests"):
        value = (resources.get(key) or {}).get(MEMORY)
        if value is not None:
            return quantity(value)
    return None


@dataclass(frozen=True)
class OomPolicy:
    """spec.oom as the operator reads it: the factor a killed role's memory grows by, and
    the most it may grow to (None: the template gives no memory, so no cap)."""

    increase: float
    cap: Decimal | None

    def raised(self, now: Decimal) -> Decimal:
        """`now` grown by `increase`, at most the cap, rounded up to a whole MiB."""
        grown = Decimal(math.ceil(now * Decimal(str(self.increase)) / _MI) * _MI)
        return grown if self.cap is None else min(grown, self.cap)


def policy(section: OomJson, template: KubeObject) -> OomPolicy:
    """The OomPolicy of spec.oom and spec.template: spec.oom.maxMemory for the cap, else
    DEFAULT_CAP times the template's memory."""
    given = section.get("maxMemory")
    base = template_memory(template)
    cap = quantity(given) if given is not None else None if base is None else base * DEFAULT_CAP
    return OomPolicy(section.get("increase", INCREASE), cap)


def text(amount: Decimal) -> str:
    """A memory amount as a Kubernetes quantity: whole Gi or Mi where it is one, else bytes."""
    whole = int(amount)
    for suffix, size in (("Gi", 2**30), ("Mi", _MI)):
        if whole % size == 0:
            return f"{whole // size}{suffix}"
    return str(whole)
