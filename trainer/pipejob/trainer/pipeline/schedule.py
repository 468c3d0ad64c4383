"""The master's side of one step: micro-batches pipelined through the remote stages (GPipe:
all forwards of a step, then all backwards, then every stage's optimizer step).

For every micro-batch the master chains RRefs, so stage i+1 fetches its input from stage i
(activations never pass through the master), and only the last stage's output returns. The
loss is computed on the master, `dist_autograd` runs the backward across the stages and
`DistributedOptimizer` steps every shard's parameters where they live."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline.shards import (
    Shards,
)
from pipejob.trainer.pipeline.stage import Stage, on_stage
from pipejob.trainer.runtime import (
    rendezvous,
)
from pipejob.trainer.runtime.optim import optimizer_args
from pipejob.trainer.workloads import Loss

# Micro-batches a stage holds at once; fewer than the RPC worker threads (runtime/rendezvous).
IN_FLIGHT = 4


class Pipeline:
    """The master's handle on the remote shards: creates them and runs micro-batches.

    Calls go through `on_stage` rather than RRef proxies (`rref.rpc_async().forward`): a
    proxy's first call is sent from a callback thread once it has fetched the RRef's type,
    outside the distributed autograd context, which silently drops that micro-batch's
    gradients."""

    def __init__(self, stage_names: list[str], shards: Shards, device: str = "cpu"):
        last = len(stage_names) - 1
        self.names = stage_names
        self.stages = [
            rpc.remote(name, Stage, args=(shards.of(i), i == last, device))
            for i, name in enumerate(stage_names)
        ]

    def forward(self, images: torch.Tensor, micro_batches: int, step: int) -> torch.Tensor:
        """All micro-batches' forwards, pipelined; the last stage's outputs, in order.

        Stage k gets micro-batch i's input as stage k-1's RRef and fetches it from there. A
        stage holds at most IN_FLIGHT micro-batches at a time: each waits for its input, then
        for its turn (the stage computes them in order), on one of the stage's RPC threads,
        and once every thread waits, none is left to complete the fetches they wait for. Each
        stage's micro-batches are launched in order, so the one whose turn it is is always
        among those it holds. Completions only post to a queue; every call is issued from
        this thread, inside the distributed autograd context."""
        last = len(self.stages) - 1
        inputs = [x.clone() for x in images.tensor_split(micro_batches)]  # views ship it all
        refs: dict[tuple[int, int], RRef] = {}
        finished: queue.SimpleQueue = queue.SimpleQueue()

        def launch(k: int, mb: int) -> None:
            args = (self.stages[k], "forward", inputs[mb] if k == 0 else refs[k - 1, mb], step, mb)
            if k == last:
                future = rpc.rpc_async(self.names[k], on_stage, args=args)
            else:
                refs[k, mb] = rpc.remote(self.names[k], on_stage, args=args)
                future = refs[k, mb]._get_future()  # done once the stage has computed it
            future.then(lambda f: finished.put((k, mb, f)))

        launched = [0] * (last + 1)  # micro-batches launched on each stage, in order
        busy = [0] * (last + 1)

        def fill() -> None:
            # Completions arrive in any order (stage k may report micro-batch i before stage
            # k-1 does): launch only once the input's RRef exists and the stage has a slot.
            for k in range(last + 1):
                while (launched[k] < micro_batches and busy[k] < IN_FLIGHT
                       and (k == 0 or launched[k] < launched[k - 1])):  # fmt: skip
                    launch(k, launched[k])
                    launched[k] += 1
                    busy[k] += 1

        fill()
        outputs: dict[int, torch.Tensor] = {}
        for _ in range((last + 1) * micro_batches):
            try:
                k, mb, future = finished.get(timeout=rendezvous.RPC_TIMEOUT_SECONDS)
            except queue.Empty:
                raise TimeoutError(
                    f"no stage finished a forward within {rendezvous.RPC_TIMEOUT_SECONDS:g}s"
                ) from None
            value = future.wait()  # raises if the stage failed
            if k == last:
                outputs[mb] = value
            busy[k] -= 1
            fill()
        return torch.cat([outputs[mb] for mb in range(micro_batches)])

    def parameter_rrefs(self) -> list[RRef]:
        return [p for params in self._each("parameter_rrefs") for p in params]

    def timings(self) -> list[dict[int, tuple[float, float, float]]]:
        return self._each("timings")

    def _each(self, method: str) -> list[Any]:
        return [
            rpc.rpc_sync(name, on_stage, args=(stage, method))
            for name, stage in zip(self.names, self.stages, strict=True)
        ]


def make_optimizer(pipeline: Pipeline, spec: PipelineSpec) -> DistributedOptimizer:
    """One optimizer per stage, stepping each shard's parameters where they live."""
    cls, kwargs = optimizer_args(spec.optimizer)
    return DistributedOptimizer(cls, pipeline.parameter_rrefs(), **kwargs)


@dataclass(frozen=True)
class StepResult:
    loss: float
    pipeline_seconds: float  # forwards and backwards, all micro-batches
    optimizer_seconds: float


def forward_backward(
    pipeline: Pipeline,
    images: torch.Tensor,
    labels: torch.Tensor,
    micro_batches: int,
    step: int,
    context_id: int,
    loss_fn: Loss,
) -> torch.Tensor:
    """Every micro-batch forward, one loss over the whole batch (the mean over its samples,
    as without a pipeline), then the backward across the stages. Returns the loss."""
    outputs = pipeline.forward(images, micro_batches, step)
    loss = loss_fn(outputs, labels)
    dist_autograd.backward(context_id, [loss])
    return loss


def train_step(
    pipeline: Pipeline,
    optimizer: DistributedOptimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    micro_batches: int,
    step: int,
    loss_fn: Loss,
) -> StepResult:
    """One GPipe step: forwards, backwards, then every stage's optimizer step."""
    with dist_autograd.context() as context_id:
        start = time.perf_counter()
        loss = forward_backward(pipeline, images, labels, micro_batches, step, context_id,
                                loss_fn)  # fmt: skip
        middle = time.perf_counter()
        optimizer.step(context_id)
    return StepResult(loss.item(), middle - start, time.perf_counter() - middle)
