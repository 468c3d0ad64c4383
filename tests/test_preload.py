"""A process imports the job's own modules (spec.model.import, spec.data.import,
spec.loss.import), and so the libraries they import, before it joins the RPC world: calls'
arguments are unpickled on RPC threads, several at once, and a library whose modules import
each other (MONAI's, whose MetaTensor a stage unpickles while another thread builds its
DynUNet) fails to import in two threads at once (issue 56: a DynUNet job's stage died with
"cannot import name 'CacheDataset' from partially initialized module 'monai.data'")."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from jobrun import pipeline_job
from pipejob.core import spec
from pipejob.trainer.runtime import roles

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def user_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A library, and the user's model, data and loss modules importing it at their top."""
    (tmp_path / "circlib").mkdir()
    (tmp_path / "circlib" / "__init__.py").write_text("")
    for name in ("usermodel", "userdata", "userloss"):
        (tmp_path / f"{name}.py").write_text("import circlib\n\ndef build(**_):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("circlib", "usermodel", "userdata", "userloss"):
        sys.modules.pop(name, None)


def _env(**fields) -> SimpleNamespace:
    return SimpleNamespace(spec=spec.parse(pipeline_job("preload", **fields)).settings)


@pytest.mark.parametrize(
    "fields",
    [
        {"model": {"import": "usermodel:build"}},
        {"data": {"import": "userdata:build"}},
        {"loss": {"import": "userloss:build"}},
    ],
    ids=["model", "data", "loss"],
)
@pytest.mark.parametrize("role", ["serve", "drive"])
def test_the_jobs_modules_are_imported_before_the_rpc_world_is_joined(
    user_modules, monkeypatch, fields, role
):
    imported: list[bool] = []
    monkeypatch.setattr(
        roles.rendezvous, "join_rpc", lambda *_, **__: imported.append("circlib" in sys.modules)
    )
    monkeypatch.setattr("torch.distributed.rpc.shutdown", lambda *_, **__: None)
    env = _env(**fields)
    if role == "serve":
        roles.serve(env)
    else:
        roles.drive(env, lambda _: {})
    assert imported == [True]


def test_a_module_that_does_not_import_is_left_to_the_build_which_names_the_field(monkeypatch):
    monkeypatch.setattr(roles.rendezvous, "join_rpc", lambda *_, **__: None)
    monkeypatch.setattr("torch.distributed.rpc.shutdown", lambda *_, **__: None)
    roles.serve(_env(model={"import": "no_such_module_here:build"}))  # does not raise
