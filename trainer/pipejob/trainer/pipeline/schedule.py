"""The master's side of one step: micro-batches pipelined through the remote stages (GPipe:
all forwards of a step, then all backwards, then every stage's optimizer step).

The master only sends control messages. The first stage reads each round's batch itself
(pipeline/reader.py); for every micro-batch the master chains RRefs, so stage i+1 fetches
its input from stage i (activations never pass through the master). The last stage keeps
the model's outputs and computes the loss against the labels it fetches from the first
stage; `dist_autograd` runs the backward from it across the stages and
`DistributedOptimizer` steps every shard's parameters where they live. Evaluation takes the
same path, the last stage adding each round's figures to a `Tally`."""

from __future__ import annotations

import math
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline import gradients
from pipejob.trainer.pipeline.reader import HELD_OUT, TRAIN, Batch, Source
from pipejob.trainer.pipeline.shards import Shards
from pipejob.trainer.pipeline.stage import Stage, on_reader, on_stage
from pipejob.trainer.runtime import nonfinite, rendezvous
from pipejob.trainer.runtime.optim import learning_rate, optimizer_args
from pipejob.trainer.workloads import Loss
from pipejob.trainer.workloads.metrics import Tally

# Micro-batches a stage holds at once; fewer than the RPC worker threads (runtime/rendezvous).
IN_FLIGHT = 4


@dataclass(frozen=True)
class Round:
    """A forward round's batch, read on the first stage: training or evaluation."""

    number: int  # the stages' order of rounds
    micro_batches: int  # as the first stage split it: no more than its samples
    labels: RRef  # on the first stage; the last fetches them from there


class Pipeline:
    """The master's handle on the remote shards: creates them and runs micro-batches.

    Calls go through `on_stage` rather than RRef proxies (`rref.rpc_async().forward`): a
    proxy's first call is sent from a callback thread once it has fetched the RRef's type,
    outside the distributed autograd context, which silently drops that micro-batch's
    gradients."""

    def __init__(self, stage_names: list[str], shards: Shards, device: str = "cpu",
                 precision: str = "fp32", recompute: bool = False,
                 source: Source | None = None):  # fmt: skip
        """`source`: where the first stage reads the training and held-out batches; without
        it, every round's batch is given (`read`)."""
        last = len(stage_names) - 1
        self.names = stage_names
        self.stages = [
            rpc.remote(name, Stage, args=(shards.parts[i] if shards.parts else shards.stages[i],
                                          i == last, device, precision, recompute,
                                          source if i == 0 else None))
            for i, name in enumerate(stage_names)
        ]  # fmt: skip
        self.rounds = 0  # forward rounds (training steps and evaluation batches) so far

    def read(self, micro_batches: int, given: Batch | None = None,
             what: str = TRAIN) -> Round | None:  # fmt: skip
        """The next round's batch, on the first stage: `given` (sent there), or read there,
        the next of `what` (TRAIN, or HELD_OUT once `start_held_out`); None when the
        held-out set is over."""
        self.rounds += 1
        if given is not None:  # a view would ship its whole storage
            given = (given[0].clone(), given[1].clone())
        samples = self.reader("read", self.rounds, micro_batches, what, given)
        if samples == 0:
            return None
        labels = rpc.remote(self.names[0], on_reader, args=(self.stages[0], "labels", self.rounds))
        return Round(self.rounds, min(micro_batches, samples), labels)

    def forward(self, batch: Round, step: int | None) -> None:
        """All micro-batches' forwards of `batch`, pipelined. `step` None: an evaluation's
        forwards (no autograd, shards in eval mode). The outputs stay on the last stage, for
        `loss` or `tally`.

        Stage k gets micro-batch i's input as stage k-1's RRef and fetches it from there. A
        stage holds at most IN_FLIGHT micro-batches at a time: each waits for its input, then
        for its turn (the stage computes them in order), on one of the stage's RPC threads,
        and once every thread waits, none is left to complete the fetches they wait for. Each
        stage's micro-batches are launched in order, so the one whose turn it is is always
        among those it holds. Completions only post to a queue; every call is issued from
        this thread, inside the distributed autograd context."""
        last = len(self.stages) - 1
        micro_batches, round = batch.micro_batches, batch.number
        refs: dict[tuple[int, int], RRef] = {}
        finished: queue.SimpleQueue = queue.SimpleQueue()

        def launch(k: int, mb: int) -> None:
            given = None if k == 0 else refs[k - 1, mb]  # the first stage's reader has it
            args = (self.stages[k], "forward", given, round, mb, step)
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
        for _ in range((last + 1) * micro_batches):
            try:
                k, mb, future = finished.get(timeout=rendezvous.RPC_TIMEOUT_SECONDS)
            except queue.Empty:
                raise TimeoutError(
                    f"no stage finished a forward within {rendezvous.RPC_TIMEOUT_SECONDS:g}s"
                ) from None
            future.wait()  # raises if the stage failed
            busy[k] -= 1
            fill()

    def loss(self, batch: Round, loss_fn: Loss) -> torch.Tensor:
        """A training round's loss, computed on the last stage (Stage.loss)."""
        return rpc.rpc_sync(self.names[-1], on_stage,
                            args=(self.stages[-1], "loss", batch.number, batch.micro_batches,
                                  batch.labels, loss_fn))  # fmt: skip

    def evaluate(self, micro_batches: int, limit: int, loss_fn: Loss, tally: Tally) -> Tally:
        """`tally` with the held-out set's figures (its first `limit` batches, all when 0):
        the first stage reads each batch, the last adds its figures (Stage.tally)."""
        self.reader("start_held_out", limit)
        while (batch := self.read(micro_batches, what=HELD_OUT)) is not None:
            self.forward(batch, None)
            args = (self.stages[-1], "tally", batch.number, batch.micro_batches, batch.labels,
                    loss_fn, tally)  # fmt: skip
            tally = rpc.rpc_sync(self.names[-1], on_stage, args=args)
        return tally

    def reader(self, method: str, *args: Any) -> Any:
        """Call a method of the first stage's Reader (pipeline/reader.py)."""
        return rpc.rpc_sync(self.names[0], on_reader, args=(self.stages[0], method, *args))

    def settle(self, step: int, micro_batches: int) -> None:
        """Return once every stage has backpropagated every micro-batch of `step`
        (Stage.settle): only then are the step's gradients whole."""
        torch.futures.wait_all([
            rpc.rpc_async(name, on_stage, args=(stage, "settle", step, micro_batches))
            for name, stage in zip(self.names, self.stages, strict=True)
        ])  # fmt: skip

    def combine_tied(self, context_id: int, tied: list[list[tuple[int, str]]]) -> None:
        """Each parameter several stages hold (tied embeddings, cut.ties) gets the sum of its
        copies' gradients in every copy, as one shared tensor would (Megatron's way)."""
        for group in tied:
            grads = torch.futures.wait_all([
                rpc.rpc_async(self.names[k], on_stage,
                              args=(self.stages[k], "gradient", context_id, name))
                for k, name in group
            ])  # fmt: skip
            total = torch.stack(grads).sum(0)
            torch.futures.wait_all([
                rpc.rpc_async(self.names[k], on_stage,
                              args=(self.stages[k], "set_gradient", context_id, name, total))
                for k, name in group
            ])  # fmt: skip

    def nonfinite_source(self, rounds: list[int]) -> str:
        """Where a non-finite loss of training rounds `rounds` came from: the first stage
        whose forward gave a non-finite output, else the loss on the last stage."""
        for name, stage in zip(self.names, self.stages, strict=True):
            if rpc.rpc_sync(name, on_stage, args=(stage, "nonfinite", rounds)):
                return f"{name}'s forward"
        return f"the loss on {self.names[-1]} (from finite outputs)"

    def parameter_rrefs(self) -> list[RRef]:
        return [p for params in self.each("parameter_rrefs") for p in params]

    def timings(self) -> list[dict[int, tuple[float, float, float]]]:
        return self.each("timings")

    def each(self, method: str) -> list[Any]:
        return [
            rpc.rpc_sync(name, on_stage, args=(stage, method))
            for name, stage in zip(self.names, self.stages, strict=True)
        ]


@dataclass(frozen=True)
class StepResult:
    loss: float  # the mean over every replica's batch
    pipeline_seconds: float  # forwards and backwards, all micro-batches (slowest replica)
    optimizer_seconds: float  # averaging gradients across replicas, then stepping
    allreduce_seconds: float = 0.0  # of which the slowest stage's all-reduce
    lr: float | None = None  # the learning rate the optimizer stepped with
    grad_norm: float | None = None  # the global gradient norm before clipping
    # A figure that was not finite, its value and where it came from (runtime/nonfinite.py):
    # the step was not applied.
    nonfinite: tuple[str, float, str] | None = None
    skipped: str | None = None  # the line saying that the Guard let the step be skipped


def forward_backward(
    pipeline: Pipeline,
    batch: Round,
    step: int,
    context_id: int,
    loss_fn: Loss,
    scale: float = 1.0,
) -> torch.Tensor:
    """Every micro-batch of `batch` forward, one loss over the whole batch (the mean over
    its samples, as without a pipeline) on the last stage, then the backward across the
    stages of the loss times `scale` (1 / gradientAccumulation, times fp16's loss scale).
    Returns the loss."""
    pipeline.forward(batch, step)
    loss = pipeline.loss(batch, loss_fn)
    dist_autograd.backward(context_id, [loss * scale if scale != 1.0 else loss])
    return loss


class Replicas:
    """Every copy of the pipeline, each with its own DistributedOptimizer over its stages.

    One step: each replica's first stage reads the replica's share of the batch (or a
    given batch is split into one share per replica); each replica runs its share's
    forwards and backwards in a dist-autograd context of its own (a thread each, so the
    replicas' pipelines overlap), then its stages average their gradients with the same
    stage of the other replicas (`Stage.average_gradients`) and its optimizer steps. The mean
    of the replicas' losses is the loss of the whole batch, and the averaged gradients its
    gradients: R replicas compute what one pipeline computes on their union.

    With gradientAccumulation N the step's batch is N batches, run one after the other,
    each loss weighted 1/N; their gradients add up on the stages into the last one's
    context. Before the optimizer steps, the replica's stages give their gradients' global
    norm, which clips them (gradients.py), and the optimizer gets the schedule's learning
    rate; with fp16 the loss is scaled and an overflowed step skipped."""

    def __init__(self, names: list[list[str]], shards: Shards, spec: PipelineSpec,
                 device: str = "cpu"):  # fmt: skip
        cls, kwargs = optimizer_args(spec.optimizer)
        self.optimizer, self.steps = spec.optimizer, spec.steps
        self.accumulation = spec.gradient_accumulation
        self.loss_scale = gradients.LossScale() if spec.precision == "fp16" else None
        self.guard = nonfinite.Guard(spec.skip_non_finite_steps)
        self.pipelines = [Pipeline(stage_names, shards, device, spec.precision,
                                   spec.activation_checkpointing, Source(spec, r))
                          for r, stage_names in enumerate(names)]  # fmt: skip
        self.tied = shards.tied
        self.optimizers = [DistributedOptimizer(cls, p.parameter_rrefs(), **kwargs)
                           for p in self.pipelines]  # fmt: skip
        self._threads = ThreadPoolExecutor(len(names)) if len(names) > 1 else None

    def step(self, micro_batches: int, step: int, loss_fn: Loss,
             given: Batch | None = None) -> StepResult:  # fmt: skip
        """One optimizer step on gradientAccumulation batches, one after the other: the
        next ones each first stage reads, or `given` (inputs and labels of them all)."""
        replicas = len(self.pipelines)
        shares: list[list[Batch | None]] = [[None] * self.accumulation for _ in range(replicas)]
        if given is not None:
            inputs, labels = given
            rounds = zip(inputs.tensor_split(self.accumulation),
                         labels.tensor_split(self.accumulation), strict=True)  # fmt: skip
            for a, (x, y) in enumerate(rounds):
                for r, share in enumerate(zip(x.tensor_split(replicas), y.tensor_split(replicas),
                                              strict=True)):  # fmt: skip
                    shares[r][a] = share
        args = [(r, share, micro_batches, step, loss_fn) for r, share in enumerate(shares)]
        if self._threads is None:
            results = [self._one(*args[0])]
        else:
            results = list(self._threads.map(lambda a: self._one(*a), args))
        bad = next((r.nonfinite for r in results if r.nonfinite is not None), None)
        skipped = None if bad is None else self.guard.check(step + 1, *bad)  # or raises
        if self.loss_scale is not None:  # every replica saw the same averaged gradients
            self.loss_scale.update(results[0].grad_norm)
        return StepResult(
            sum(r.loss for r in results) / len(results),
            max(r.pipeline_seconds for r in results),
            max(r.optimizer_seconds for r in results),
            max(r.allreduce_seconds for r in results),
            results[0].lr,
            results[0].grad_norm,
            bad,
            skipped,
        )

    def _one(self, r: int, rounds: list[Batch | None], micro_batches: int, step: int,
             loss_fn: Loss) -> StepResult:  # fmt: skip
        """Replica r's part of a step: its share of each batch of the step (None: read by
        its first stage)."""
        pipeline = self.pipelines[r]
        names, stages = pipeline.names, pipeline.stages
        scale = 1.0 if self.loss_scale is None else self.loss_scale.scale
        weight = scale / len(rounds)  # each batch's share of the step's loss

        numbers: list[int] = []  # the forward rounds of the step

        def one_round(given: Batch | None, context_id: int) -> float:
            batch = pipeline.read(micro_batches, given)
            assert batch is not None  # the training data has no end
            numbers.append(batch.number)
            loss = forward_backward(pipeline, batch, step, context_id, loss_fn, weight)
            pipeline.settle(step, batch.micro_batches)
            return loss.item()

        start = time.perf_counter()
        losses = []
        # A context takes one backward: the rounds before the last each have their own, and
        # the stages hold their gradients until the last round's context, where they add up.
        for given in rounds[:-1]:
            with dist_autograd.context() as context_id:
                losses.append(one_round(given, context_id))
                gradients.hold(names, stages, context_id)
        with dist_autograd.context() as context_id:
            losses.append(one_round(rounds[-1], context_id))
            if len(rounds) > 1:
                gradients.release(names, stages, context_id)
            pipeline.combine_tied(context_id, self.tied)
            middle = time.perf_counter()
            allreduce = 0.0
            if len(self.pipelines) > 1:
                averaging = [rpc.rpc_async(name, on_stage,
                                           args=(stage, "average_gradients", context_id))
                             for name, stage in zip(pipeline.names, pipeline.stages,
                                                    strict=True)]  # fmt: skip
                allreduce = max(torch.futures.wait_all(averaging))
            norms = gradients.stage_norms_of(names, stages, context_id, 1.0 / scale,
                                             gradients.copies(self.tied))  # fmt: skip
            norm = gradients.total_norm(norms)
            loss = sum(losses) / len(losses)
            lr = learning_rate(self.optimizer, self.steps, step)
            bad = None
            if not math.isfinite(loss):
                bad = ("loss", loss, pipeline.nonfinite_source(numbers))
            elif self.loss_scale is None and not math.isfinite(norm):
                # The backward runs from the last stage to the first: the latest stage whose
                # gradients are not finite is where they became so.
                k = max(k for k, n in enumerate(norms) if not math.isfinite(n))
                bad = ("gradient norm", norm, f"{names[k]}'s backward")
            # fp16: an overflow is skipped by the loss scale
            if bad is None and (self.loss_scale is None or math.isfinite(norm)):
                gradients.clip(names, stages, context_id, norm, self.optimizer.clip_grad_norm)
                if self.optimizer.schedule is not None:
                    gradients.set_lr(self.optimizers[r], lr)
                self.optimizers[r].step(context_id)
        return StepResult(loss, middle - start, time.perf_counter() - middle, allreduce, lr,
                          norm, bad)  # fmt: skip

    def timings(self) -> list[dict[int, tuple[float, float, float]]]:
        """Replica 0's stages' timings (every replica runs the same schedule)."""
        return self.pipelines[0].timings()

    def data_state(self) -> dict[str, Any]:
        """The training data's position (every replica's first stage is at the same one)."""
        return self.pipelines[0].reader("state")

    def readers(self, method: str, *args: Any) -> None:
        """Call a method of every replica's first stage's Reader: `load_state` (a
        checkpoint's position), `close` (stop reading)."""
        torch.futures.wait_all([rpc.rpc_async(p.names[0], on_reader,
                                              args=(p.stages[0], method, *args))
                                for p in self.pipelines])  # fmt: skip

    def divergence(self) -> float:
        """The largest difference between a replica's parameter fingerprints and replica
        0's (Stage.fingerprint): 0.0 while the replicas stay identical, as they must."""
        if len(self.pipelines) == 1:
            return 0.0
        prints = [p.each("fingerprint") for p in self.pipelines]
        return max((torch.max((a - b).abs()).item()
                    for other in prints[1:] for a, b in zip(prints[0], other, strict=True)),
                   default=0.0)  # fmt: skip
