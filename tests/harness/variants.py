"""Parametrized cases of which `make test` runs a few and `make test-all` every one."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def exhaustive(cases: Iterable[str], kept: set[str]) -> list:
    """The cases, those not `kept` marked `slow` (tests/README.md says what holds each)."""
    cases = list(cases)
    assert kept <= set(cases), kept - set(cases)  # a kept case renamed away would go unseen
    return [c if c in kept else pytest.param(c, marks=pytest.mark.slow) for c in cases]
