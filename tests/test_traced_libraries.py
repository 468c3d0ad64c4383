"""Libraries' type checks on the traced path (issue 56, class 5): the tracer's stand-in
passes `isinstance(x, torch.Tensor)` (kornia's KORNIA_CHECK_IS_TENSOR), and a check it
cannot pass is refused at the user's line, not at the library's `raise`. The libraries
are written here as `pip install --target` lays them out (a package beside its
dist-info), with the user's model in a module of its own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pipejob.trainer.workloads.cut import CutError, Traced

pytestmark = pytest.mark.timeout(60)

LIBRARY = """
import torch


def checked_blur(x):
    if not isinstance(x, torch.Tensor):  # kornia's KORNIA_CHECK_IS_TENSOR
        raise TypeError(f"Type mismatch: expected Tensor, got {type(x)}.")
    return torch.nn.functional.avg_pool2d(x, 3, 1, 1)


def strict(x):
    if type(x) is not torch.Tensor:  # no stand-in passes this
        raise TypeError(f"expected Tensor, got {type(x).__name__}")
    return x
"""

MODEL = """
from torch import nn

import checklib


class Model(nn.Module):
    def __init__(self, strict=False):
        super().__init__()
        self.strict = strict
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(4, 4, 1)
        self.c = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        x = self.a(x)
        x = checklib.strict(x) if self.strict else checklib.checked_blur(x)
        return self.c(self.b(x)).flatten(1)
"""


@pytest.fixture
def model_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    target = tmp_path / "target"
    (target / "checklib").mkdir(parents=True)
    (target / "checklib-1.0.dist-info").mkdir()
    (target / "checklib" / "__init__.py").write_text(LIBRARY)
    (tmp_path / "usermodel.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(target))
    monkeypatch.syspath_prepend(str(tmp_path))
    import usermodel

    yield usermodel
    for name in ("usermodel", "checklib"):
        sys.modules.pop(name, None)


def test_a_librarys_isinstance_check_passes_on_the_stand_in(model_module):
    torch.manual_seed(0)
    model, x = model_module.Model(), torch.randn(2, 3, 6, 6)
    traced = Traced(model, 3, sample=x)
    assert not traced.whole, traced.whole
    first, last = traced.split(["b"])
    passed = first(x)
    got = last(*passed) if isinstance(passed, tuple) else last(passed)
    torch.testing.assert_close(got, model(x), rtol=0, atol=0)


def test_a_check_no_stand_in_passes_is_refused_at_the_users_line(model_module):
    with pytest.raises(CutError) as refused:
        Traced(model_module.Model(strict=True), 3, sample=torch.randn(2, 3, 6, 6))
    said = str(refused.value)
    assert "TypeError: expected Tensor" in said
    assert "at usermodel.py:17: x = checklib.strict(x) if self.strict" in said, said
    assert "__init__.py" not in said
