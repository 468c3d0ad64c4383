"""Elastic sizes: a PipelineJob's `replicas` and a HybridJob's `trainers` are a number or
`{min, max}`; the operator runs the largest world between them that fits
(operator/elastic_world.py), and a step trains on the full size's batch at every size.
docs/architecture.md, "From manifest to processes", step 3."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict, TypeVar

from pipejob.core.schema import Field, Rule

if TYPE_CHECKING:  # kind.py and common_spec.py read Size
    from pipejob.core.common_spec import CommonSpec
    from pipejob.core.kind import Kind


class SizeJson(TypedDict):
    """An elastic size as the spec writes it."""

    min: int
    max: int


@dataclass(frozen=True, kw_only=True)
class Size:
    """A size as the spec gives it: n is {min: n, max: n}."""

    min: int
    max: int

    @classmethod
    def parse(cls, value: int | SizeJson) -> Size:
        """The size a spec's number or {min, max} gives."""
        if isinstance(value, dict):
            return cls(min=value["min"], max=value["max"])
        return cls(min=value, max=value)

    @property
    def elastic(self) -> bool:
        return self.min < self.max


def size_field(what: str, default: int, minimum: int, maximum: int) -> Field:
    """The spec field of a kind's elastic size: a number, or {min, max} of `what`."""
    bound = {"minimum": minimum, "maximum": maximum}
    return Field(
        "int-or-object",
        f"{what} A number is the world's size; {{min, max}} makes it elastic: the operator"
        " runs the largest world between them that fits, restarts it smaller (never below"
        " min) when pods stay unschedulable for elastic.pendingSeconds, and larger again at"
        " the next checkpoint once the missing pods can run. The batch stays what the spec"
        " says at max (batchSize per member at max): a smaller world gives each member a"
        " bigger share. Needs spec.checkpoint.",
        default=default,
        fields={
            "min": Field("integer", "The smallest size the world may run at.", default=1, **bound),
            "max": Field(
                "integer",
                "The size the world runs at when it fits; batchSize is per member at this size.",
                **bound,
            ),
        },
        required=("max",),
        rules=(
            Rule(
                "self.min <= self.max",
                "min must be at most max",
                "min",
                lambda s: s["min"] <= s["max"],
            ),
        ),
        **bound,
    )


def full_size(value: int | SizeJson) -> int:
    """The largest size: what the spec's batch is given for."""
    return Size.parse(value).max


def cel_full_size(field: str) -> str:
    """`full` of `self.<field>` in CEL."""
    return f"(type(self.{field}) == int ? self.{field} : self.{field}.max)"


def needs_checkpoint(field: str) -> Rule:
    """An elastic size resumes from checkpoints each time the world changes size."""
    return Rule(
        f"type(self.{field}) == int || has(self.checkpoint)",
        f"an elastic {field} ({{min, max}}) needs spec.checkpoint: a world restarted at"
        " another size resumes from the last checkpoint",
        field,
        lambda s: isinstance(s[field], int) or "checkpoint" in s,
    )


def elastic_acts(field: str) -> Rule:
    """spec.elastic steers a world whose size may change: on a fixed size it cannot act."""
    return Rule(
        f"!has(self.elastic) || (type(self.{field}) != int && self.{field}.min < self.{field}.max)",
        f"acts only on a world whose {field} is a range ({{min, max}} with min < max);"
        f" {field} is fixed here: leave elastic out, or give {field} a range",
        "elastic",
        lambda s: "elastic" not in s or Size.parse(s[field]).elastic,
    )


def elastic_size(kind: Kind, settings: CommonSpec) -> Size | None:
    """The kind's elastic size in its `settings`, or None when the kind has none."""
    return None if kind.elastic is None else getattr(settings, kind.elastic)


Settings = TypeVar("Settings", bound="CommonSpec")


def shape(kind: Kind, settings: Settings, size: int | None = None) -> Settings:
    """`settings` with their elastic size one number ({min: n, max: n}): `size`, or the
    largest. What the world plan counts members from (Role.members, Role.copies)."""
    found = elastic_size(kind, settings)
    if found is None or kind.elastic is None:
        return settings
    if size is not None and not found.min <= size <= found.max:
        raise ValueError(
            f"spec.{kind.elastic}: a world of {size} is outside {found.min} to {found.max}"
        )
    n = found.max if size is None else size
    return dataclasses.replace(settings, **{kind.elastic: Size(min=n, max=n)})
