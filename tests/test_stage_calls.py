"""Typed stage calls (pipeline/stage_calls.py): the master names an RpcStage's or a Reader's method
itself, a misspelt one fails where it is written, and what travels is `on_stage` (or
`on_reader`) with the method's name, which the watchdog names an open call by."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch.distributed.rpc as rpc

from pipejob.trainer.pipeline import stage_calls
from pipejob.trainer.pipeline.reader import Reader
from pipejob.trainer.pipeline.rpc.stage import RpcStage
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.runtime import rpc_ledger

pytestmark = pytest.mark.timeout(30)
STAGE = stage_calls.StageRef("stage0", 0)


def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, Any, Any]]:
    """What the calls would send, by torch's function: (which, to, function, args)."""
    made: list[tuple[str, str, Any, Any]] = []
    for which in ("rpc_async", "rpc_sync", "remote"):

        def record(to: str, func: Any, args: Any = None, kwargs: Any = None, w: str = which):
            made.append((w, to, func, args))

        monkeypatch.setattr(rpc, which, record)
    return made


def test_a_call_sends_on_stage_the_stages_key_and_the_methods_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = sent(monkeypatch)
    first, second = stage_calls.StageRef("stage0", 7), stage_calls.StageRef("stage1", 8)
    stage_calls.remote_stage(second).future(RpcStage.forward, None, 3, 0, 1, None)
    stage_calls.remote_stage(first).result(StageBase.save, "/tmp/x", "stage0.pt")
    stage_calls.remote_stage(first).rref(RpcStage.settle, 1, 4)
    stage_calls.remote_reader(first).result(Reader.labels, 3, 5.0)
    assert made == [
        ("rpc_async", "stage1", stage_calls.on_stage, (8, "forward", None, 3, 0, 1, None)),
        ("rpc_sync", "stage0", stage_calls.on_stage, (7, "save", "/tmp/x", "stage0.pt")),
        ("remote", "stage0", stage_calls.on_stage, (7, "settle", 1, 4)),
        ("rpc_sync", "stage0", stage_calls.on_reader, (7, "labels", 3, 5.0)),
    ]
    # The watchdog names an open call as before: "waiting on stage1 ... for on_stage forward".
    assert rpc_ledger._call_text(made[0][2], made[0][3]) == "on_stage forward"


def test_a_stage_ref_travels_as_its_worker_and_key_without_its_rref() -> None:
    """A StageRef sent to a stage (RpcStage.link, StageBase.meet_first) names its worker
    there; its RRef stays with the master, and a call carries the key alone (above)."""
    ref = stage_calls.StageRef("stage1", 8, rref=object())  # type: ignore[arg-type]
    arrived = pickle.loads(pickle.dumps(ref))
    assert (arrived.name, arrived.key, arrived.rref) == ("stage1", 8, None)


def test_a_misspelt_method_fails_where_it_is_written() -> None:
    with pytest.raises(AttributeError):
        stage_calls.remote_stage(STAGE).future(StageBase.sav)  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):  # a name is no method
        stage_calls.remote_stage(STAGE).future("save")  # type: ignore[arg-type]
