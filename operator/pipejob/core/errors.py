"""The one record every validation reports: a field path and the reason it is wrong.

Its own module so that the checkers (schema.py for pipejob's tables, k8s.py for the
Kubernetes types) both use it without importing each other's module in a circle."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecError:
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"
