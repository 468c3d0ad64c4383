"""How a step ends (issue 62): one rule both engines' drivers follow (step_records.step_end),
each case of it, as each engine reads a job's spec (ReplicasBase.end), and what the step's
last round then asks of the stages (ReplicasBase.asks). That each engine carries its cases
out alike is checked by the runs: test_pipelining (IN_CALL, ALONE, runs ahead),
test_precision and test_recipes (MASTER, NORMS_IN_REPLIES)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from jobrun import pipeline_job
from pipejob.core import spec
from pipejob.trainer.pipeline.driver import ReplicasBase
from pipejob.trainer.pipeline.pipelining.driver import PipeliningReplicas
from pipejob.trainer.pipeline.rpc.driver import RpcReplicas
from pipejob.trainer.pipeline.step_records import (
    NOTHING,
    RoundAsks,
    StepEnd,
    StepShape,
    step_end,
)

pytestmark = pytest.mark.timeout(30)

PLAIN = StepShape(
    rounds=1, tied=False, replicas=1, scaled=False, clipped=False, skips_nonfinite=False
)
RPC, PIPELINING = RpcReplicas.engine_ends, PipeliningReplicas.engine_ends


def shape(**changes: Any) -> StepShape:
    return StepShape(**(PLAIN.__dict__ | changes))


# (the job, the rpc engine's end, the pipelining engine's end)
CASES = [
    # Nothing changes the gradients after the backward, nothing waits on another stage.
    (PLAIN, StepEnd.IN_CALL, StepEnd.ALONE),
    # Clipped by the global norm, or a step not finite skipped: the stages gather the figures.
    (shape(clipped=True), StepEnd.IN_CALL, StepEnd.IN_CALL),
    (shape(skips_nonfinite=True), StepEnd.IN_CALL, StepEnd.IN_CALL),
    # fp16's scale: the rpc engine leaves the step to the master, the pipelining one's
    # stages finish it (the master updates the scale after).
    (shape(scaled=True), StepEnd.NORMS_IN_REPLIES, StepEnd.IN_CALL),
    # Several rounds: the stages see only the last one's loss; the rpc engine adds the
    # earlier rounds' gradients in after the last round's call.
    (shape(rounds=2), StepEnd.MASTER, StepEnd.NORMS_IN_REPLIES),
    (shape(rounds=2, scaled=True, clipped=True), StepEnd.MASTER, StepEnd.NORMS_IN_REPLIES),
    # Tied weights' copies summed, replicas averaged: only after the rounds, by the master.
    (shape(tied=True), StepEnd.MASTER, StepEnd.MASTER),
    (shape(replicas=2), StepEnd.MASTER, StepEnd.MASTER),
    (shape(replicas=2, rounds=2, tied=True), StepEnd.MASTER, StepEnd.MASTER),
]


@pytest.mark.parametrize("job,rpc,pipelining", CASES)
def test_each_case_of_the_one_rule(job: StepShape, rpc: StepEnd, pipelining: StepEnd) -> None:
    assert step_end(job, RPC) is rpc
    assert step_end(job, PIPELINING) is pipelining


def test_what_each_end_has_the_replies_bring_and_who_steps() -> None:
    assert not StepEnd.MASTER.norms_in_replies and not StepEnd.MASTER.stepped_by_stages
    assert StepEnd.NORMS_IN_REPLIES.norms_in_replies
    assert not StepEnd.NORMS_IN_REPLIES.stepped_by_stages
    for end in (StepEnd.IN_CALL, StepEnd.ALONE):
        assert end.norms_in_replies and end.stepped_by_stages


def replicas(cls: type[ReplicasBase], replicas: int = 1, tied: bool = False, **fields: Any) -> Any:
    """The engine's step driver over a parsed job's spec, as far as its base reads it (its
    pipelines only counted: no stage is made)."""
    settings = spec.parse(pipeline_job("ends", engine="auto", **fields)).settings
    made = cls.__new__(cls)
    cut_model = SimpleNamespace(tied=[[(0, "w"), (1, "w")]] if tied else [])
    ReplicasBase.__init__(made, [None] * replicas, cut_model, settings)  # type: ignore[arg-type]
    return made


def test_each_engine_reads_its_end_from_the_spec() -> None:
    clipped = {"optimizer": {"name": "sgd", "lr": 0.1, "clipGradNorm": 1.0}}
    fp16 = {"precision": "fp16", "gpusPerStage": 1}
    for fields, rpc, pipelining in [
        ({}, StepEnd.IN_CALL, StepEnd.ALONE),
        (clipped, StepEnd.IN_CALL, StepEnd.IN_CALL),
        ({"skipNonFiniteSteps": 2}, StepEnd.IN_CALL, StepEnd.IN_CALL),
        (fp16, StepEnd.NORMS_IN_REPLIES, StepEnd.IN_CALL),
        ({"gradientAccumulation": 2}, StepEnd.MASTER, StepEnd.NORMS_IN_REPLIES),
    ]:
        assert replicas(RpcReplicas, **fields).end is rpc, fields
        assert replicas(PipeliningReplicas, **fields).end is pipelining, fields
    for cls in (RpcReplicas, PipeliningReplicas):
        assert replicas(cls, replicas=2).end is StepEnd.MASTER
        assert replicas(cls, tied=True).end is StepEnd.MASTER


def test_the_last_round_asks_what_its_end_needs_and_no_other_round_asks_anything() -> None:
    schedule = {"optimizer": {"name": "sgd", "lr": 0.1, "clipGradNorm": 1.0}}
    in_call = replicas(RpcReplicas, **schedule)
    assert in_call.asks(3, last=True) == RoundAsks(1.0, in_call.finish(3), alone=False)
    assert in_call.finish(3)[0] == 1.0  # clipGradNorm
    alone = replicas(PipeliningReplicas)
    assert alone.asks(0, last=True) == RoundAsks(1.0, alone.finish(0), alone=True)
    scaled = replicas(RpcReplicas, precision="fp16", gpusPerStage=1)
    assert scaled.asks(0, last=True) == RoundAsks(1.0 / scaled.loss_scale.scale)
    master = replicas(RpcReplicas, gradientAccumulation=2)
    assert master.asks(0, last=True) == NOTHING
    for made in (in_call, alone, scaled, master):
        assert made.asks(0, last=False) == NOTHING
