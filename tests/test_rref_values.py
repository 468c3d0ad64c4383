"""Every value the trainer keeps behind an RRef survives torch's tensor extraction.

An RPC agent with CUDA devices finds the tensors of every RRef's value by pickling it
(torch._jit_internal._extract_tensors, called from C++ when the value's future completes) and
fails the RRef when that raises, as an RpcStage holding locks once did ("cannot pickle
'_thread.RLock' object") on every GPU pipeline. A CPU agent never extracts, so this calls the
same function on the values a real world made: a PipelineJob's stages after a training step
and their forward outputs, and checks that each yields the tensors it holds (those torch must
synchronise). (The labels a first stage read reach the last stage as a call's result, behind
no RRef; a HybridJob's parameter servers keep their tables as their process's own state.)"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch._jit_internal import _extract_tensors

from jobrun import master_of, pipeline_job, run_world
from pipejob.core import plan, spec
from pipejob.runner.local import LOOPBACK, free_ports
from pipejob.trainer import workloads
from pipejob.trainer.pipeline.cut_model import plan_cut
from pipejob.trainer.pipeline.reader import Source
from pipejob.trainer.pipeline.rpc.driver import RpcPipeline, forward_backward
from pipejob.trainer.pipeline.rpc.stage import RpcStage
from pipejob.trainer.pipeline.stage_calls import remote_stage
from pipejob.trainer.workloads import data, models


def held(value: Any) -> list[torch.Tensor]:
    """The tensors a value keeps, as the trainer knows them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in held(v)]
    if isinstance(value, RpcStage):
        return [*value.layers.parameters(), *value.layers.buffers()]
    raise TypeError(f"no known tensors in a {type(value).__name__}")


def extraction(rref: rpc.RRef) -> dict[str, Any]:
    """Runs on the RRef's owner: what torch's extraction finds in its value, against what the
    value holds (by identity: the very tensors whose streams must be synchronised)."""
    value = rref.local_value()
    found = {id(t) for t in _extract_tensors(value)}
    expected = held(value)
    return {
        "type": type(value).__name__,
        "held": len(expected),
        "missing": sum(id(t) not in found for t in expected),
    }


def _world(rank: int, envs: list[dict[str, str]], out: str) -> None:
    """A real 2-stage world: the master runs one training step through the trainer's own
    RpcPipeline, then asks each owner to extract its RRefs' values."""
    if (env := master_of(rank, envs)) is None:
        return
    try:
        s = env.spec
        with data.Feed(s) as feed:
            inputs, labels = feed.batch()
        cut_model = plan_cut(s, *models.build_meta(s), env.names("stage"))
        pipe = RpcPipeline(env.names("stage"), cut_model, source=Source(s, 0))
        with dist_autograd.context() as context_id:
            forward_backward(
                pipe, pipe.read(s.micro_batches, (inputs, labels)), 0, context_id, workloads.loss(s)
            )
        # A forward output that stays on its stage (what the next stage fetches).
        output = remote_stage(pipe.stages[0]).rref(
            RpcStage.forward, (inputs[:2],), pipe.rounds + 1, 0, None
        )
        rrefs = [*(stage.rref for stage in pipe.stages), output]  # each RpcStage's own
        torch.save([rpc.rpc_sync(r.owner(), extraction, args=(r,)) for r in rrefs], out)
    finally:
        rpc.shutdown()


@pytest.mark.slow  # a world: a stage stepped in this process, below, is extracted the same way
@pytest.mark.timeout(200)
def test_every_value_behind_an_rref_gives_torch_its_tensors(tmp_path):
    job = spec.parse(pipeline_job("extract", engine="rpc", stages=2, microBatches=2, steps=1))
    ports = plan.Ports(*free_ports(4))
    envs = [p.env for p in plan.plan_world(job, lambda m: LOOPBACK, ports)]
    found = run_world(_world, envs, tmp_path / "found.pt", timeout=180)
    assert [f["type"] for f in found] == ["RpcStage", "RpcStage", "tuple"]
    for f in found:
        assert f["held"] > 0 and f["missing"] == 0, f


def test_a_stage_stepped_in_this_process_extracts_too():
    """The same without a world, after the locks were used: a stage's turnstile and
    conditions have had waiters."""
    stage = RpcStage(
        torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)), False, "cpu"
    )
    x = torch.randn(6, 3)
    y = stage.forward((x,), 1, 0, 1)
    y.sum().backward()
    stage.settle(1, 1)
    found = {id(t) for t in _extract_tensors(stage)}
    expected = held(stage)
    assert expected and all(id(t) in found for t in expected)
    # Pickled, an RpcStage is only what torch looks for: it is never sent or rebuilt.
    with pytest.raises(TypeError, match="cannot be unpickled"):
        pickle.loads(pickle.dumps(stage))
