"""Models and factories for issue 56's failure classes on the traced path
(tests/test_traced_*.py): each as a user's or a library's code writes it."""

from __future__ import annotations

from torch import nn


def failing_factory(width: int = 4) -> nn.Module:
    """A factory that raises on its own line (a user's typo, a missing file)."""
    sizes = {"small": width}
    return nn.Linear(sizes["large"], width)  # the user's line: KeyError 'large'
