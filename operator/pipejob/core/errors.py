"""The one record every validation reports: a field path and the reason it is wrong.

Its own module so that the checkers (schema.py for pipejob's tables, k8s.py for the
Kubernetes types) both use it without importing each other's module in a circle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The most of a wrong value a message quotes: the reason stays one short line.
SHOWN = 60


@dataclass(frozen=True)
class SpecError:
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def shown(value: Any) -> str:
    """`value` as a message quotes it: its repr, cut short when long (a 400-digit number, a
    70,000-character string), saying how long it was."""
    text = repr(value)
    if len(text) <= SHOWN:
        return text
    return f"{text[: SHOWN - 20]}... ({len(text)} characters)"
