"""Errors in the user's terms on the traced path (issue 56): a factory's exception is
reported at the user's line (class 10)."""

from __future__ import annotations

from pathlib import Path

import pytest
from userpkg import traced_cases

from pipejob.trainer.runtime.failures import one_line
from pipejob.trainer.workloads import imports


def test_a_factorys_error_is_reported_at_the_users_line():
    """The line that raised inside the factory, not pipejob's imports.py."""
    with pytest.raises(ValueError) as raised:
        imports.module("userpkg.traced_cases:failing_factory", "spec.model.import", {})
    said = one_line(raised.value)
    assert "spec.model.import: 'userpkg.traced_cases:failing_factory' raised KeyError" in said
    source = Path(traced_cases.__file__).read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "the user's line" in text)
    assert f"(at traced_cases.py:{line} in failing_factory)" in said, said
    assert "imports.py" not in said
