"""The rpc engine's stage side: a shard of the model on a stage worker (pipeline/stage_base.py's
StageBase), called by the master over RPC for every micro-batch; it computes them in order and
times its forwards and backwards. More in docs/architecture.md ("The rpc engine")."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.futures import Future

from pipejob.core.optimizer import Optimizer
from pipejob.trainer.pipeline.gpu_worker import GpuWorker
from pipejob.trainer.pipeline.reader import Source
from pipejob.trainer.pipeline.rpc.backward_order import BackwardOrder
from pipejob.trainer.pipeline.rpc.gradient_sum import (
    RoundGradients,
    current_context,
    walk_backward,
)
from pipejob.trainer.pipeline.rpc.round_end import RoundEnd
from pipejob.trainer.pipeline.rpc.stage_times import StageTimes
from pipejob.trainer.pipeline.rpc.turnstile import Turnstile
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.pipeline.stage_build import PieceBuilder
from pipejob.trainer.pipeline.stage_calls import StageRef, held, remote_stage
from pipejob.trainer.runtime import nonfinite, rendezvous
from pipejob.trainer.workloads import Loss, batch_values
from pipejob.trainer.workloads.batch_values import dressed, tensors, undressed
from pipejob.trainer.workloads.cut import join
from pipejob.trainer.workloads.metrics import Tally

T = TypeVar("T")
# Micro-batches on their way through the pipeline at once (`RpcStage.forward_round`); fewer than
# a stage's RPC worker threads (runtime/rendezvous): each may hold one of some stage's while it
# waits for its turn there (it arrived before the micro-batch ahead of it), and once every
# thread waits, none is left to take the micro-batch whose turn it is.
IN_FLIGHT = 8


class RpcStage(StageBase):
    """One shard of the model, held by a stage worker and called by the master over RPC;
    built here from a `PieceBuilder` (the job's model), or given as a module.

    A shard takes the values live where its stage begins (a tuple: one tensor or several)
    and returns those live where it ends; the last keeps the model's output for the loss or
    the evaluation's figures. The first stage's inputs are the rounds its `reader` read. It
    records when it computes, forward and backward, per micro-batch, and keeps per-step
    totals, so the master can report per-stage time and the pipeline's bubble."""

    def __init__(
        self,
        module: nn.Module | PieceBuilder,
        last: bool,
        device: str,
        precision: str = "fp32",
        recompute: bool = False,
        source: Source | None = None,
        optimizer: Optimizer | None = None,
    ):
        super().__init__(module, device, precision, recompute, source, optimizer)
        # A GPU stage computes on a thread and stream of its own (pipeline/gpu_worker.py).
        self.gpu = GpuWorker(self.device) if self.device.type == "cuda" else None
        # The last stage's one backward runs its micro-batches' nodes latest made first, as
        # numbered by the thread that made them: made on one thread (a GPU's or this one),
        # always in the same order (backward_order.py says why that matters).
        self._one_thread = ThreadPoolExecutor(1) if last and self.gpu is None else None
        self.last = last
        self._after: list[StageRef] = []  # the stages after this one (`link`)
        self.compute = self.computed(self.layers, last)
        # One forward at a time, in micro-batch order: micro-batches would otherwise fight
        # over the same cores and race on BatchNorm's running statistics.
        self._order = Turnstile(rendezvous.RPC_TIMEOUT_SECONDS)
        # And their backwards, where several arrive at once (backward_order.py).
        self._backward_order = BackwardOrder(rendezvous.RPC_TIMEOUT_SECONDS)
        self._record = threading.Lock()
        self.times = StageTimes(self.device)  # when it computes, forward and backward
        # Micro-batches whose backward has run through this shard, per step (`settle`).
        self._settled = threading.Condition()
        self._done: dict[int, int] = {}
        # The last stage's outputs per (round, micro-batch), until their loss or tally.
        self._outputs: dict[tuple[int, int], Any] = {}
        self._labels: dict[int, Future] = {}  # and its labels asked for (`pass_on`)
        # Each training round's gradients, by its distributed autograd context (gradient_sum.py).
        self._sums: dict[int, RoundGradients] = {}
        self._sum_buffers: dict[int, dict[str, torch.Tensor]] = {}  # by round, step to step
        self._names = {id(p): n for n, p in self.parameters_by_name.items()}

    def link(self, after: list[StageRef]) -> None:
        """The stages after this one: `pass_on` sends outputs
        to the first of them; the first stage finishes a step on all (`finish_all`)."""
        self._after = after

    def finish_all(
        self, context_id: int, coefficient: float, lr: float | None, apply: bool
    ) -> None:
        """The first stage: the step's tail (StageBase.finish_step) here and on every stage after
        it, at once."""
        others = [
            remote_stage(stage).future(
                StageBase.finish_step, context_id, coefficient, lr, apply, False
            )
            for stage in self._after
        ]
        with self.settled():
            self.finish_step(context_id, coefficient, lr, apply, False)
        torch.futures.wait_all(others)

    def forward_round(
        self,
        round: int,
        micro_batches: int,
        step: int | None,
        read: tuple[int, int] | None,
        end: RoundEnd,
    ) -> Any:
        """The first stage: every micro-batch of round `round` forward, each passed on to
        the next stage as it is computed (`pass_on`); returns once every one has reached the
        last stage, with what ending the round gave (`end`, round_end.py). At most
        IN_FLIGHT are on their way at once (each may hold an RPC thread of a stage while it
        waits for its turn there)."""
        under_way: deque[Future] = deque()
        for mb in range(micro_batches):
            if len(under_way) == IN_FLIGHT:
                under_way.popleft().wait()  # raises if a stage failed
            ending = end if mb == micro_batches - 1 else None
            under_way.append(self.pass_on(None, round, mb, step, read if mb == 0 else None, ending))
        return end.at_first(self, [future.wait() for future in under_way][-1])

    def pass_on(
        self,
        x: tuple[Any, ...] | None,
        round: int,
        micro_batch: int,
        step: int | None,
        read: tuple[int, int] | None = None,
        end: RoundEnd | None = None,
    ) -> Future:
        """`forward`, and its output sent on to the next stage's `pass_on`: the future of
        the micro-batch's arrival at the last stage. With the round's last micro-batch
        comes what ends the round (round_end.py): the future then brings its result, which
        the last stage gives and each other adds to as it passes back. Sent from inside this
        call, so that in training the distributed autograd context records the send."""
        if self.last and micro_batch == 0:  # asked for now, here by the round's loss
            with self._record:
                self._labels[round] = self.ask_labels(round)
        y = self.forward(x, round, micro_batch, step, read)
        if not self.last:
            after = self._after[0]  # its key alone travels, as in every call (stage_calls.py)
            sent = rpc.rpc_async(  # a tensor subclass's as its data, so autograd links it
                after.name, passed_on, args=(after.key, undressed(y), round, micro_batch, step, end)
            )
            if end is None:
                return sent
            return sent.then(lambda back: self._end(end.on_the_way, micro_batch + 1, back.value()))
        ended: Future = Future()
        ended.set_result(None if end is None else self._end(end.at_last, round, micro_batch + 1))
        return ended

    def _end(self, part: Callable[..., T], *args: Any) -> T:
        """This stage's `part` of a round's end (round_end.py), settled on a GPU."""
        with self.settled():
            return part(self, *args)

    def forward(
        self,
        x: tuple[Any, ...] | None,
        round: int,
        micro_batch: int,
        step: int | None,
        read: tuple[int, int] | None = None,
    ) -> Any:
        """Micro-batch `micro_batch` of forward round `round` (the turnstile's order); a
        training step's (`step`, timed, with autograd) or, with `step` None, an
        evaluation's (no autograd, the shard in eval mode). `x`: the previous stage's
        output, or None on the first stage (the round its reader read). `read`: the first
        stage reads the round first, as (micro-batches, samples) (Reader.read). All in the
        micro-batch's turn: once the round's last has run, every other's backward is timed
        and (the last stage) its output kept."""
        with self._order.turn(round, micro_batch):
            if x is None:  # the first stage's: read in its turn, after micro-batch 0's read
                x = self._input(round, micro_batch, read)
            else:  # from the stage before: a tensor subclass as it computed it
                x = dressed(x)
                if step is not None:
                    self.check_linked(x)
            received = x
            x = tuple(v.to(self.device) if isinstance(v, torch.Tensor) else v for v in x)
            if micro_batch == 0:
                self.settle_device()
            if step is None:
                y = self._on_device(self._evaluate, x)
            else:
                start, y, end, finite = self._on_device(self._timed, x)
                # By round too: with gradientAccumulation a step runs several rounds.
                self.times.forward(step, (round, micro_batch), start, end)
                self.note_finite(step, round, finite)
                sums = self._round_gradients(step, round)
                self._time_backward((step, (round, micro_batch)), y, received, sums)
            if self.last:  # kept for its loss or tally: the model's output stays here
                with self._record:
                    self._outputs[round, micro_batch] = y
                return None
        return y

    def _input(self, round: int, micro_batch: int, read: tuple[int, int] | None) -> Any:
        """The first stage's input of a micro-batch; with `read`, the round read first."""
        if read is not None:
            self.reader.read_planned(round, *read)
        return self.reader.input(round, micro_batch)

    def _on_device(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` where this stage computes: its GPU worker, or here on a CPU."""
        if self.gpu is not None:
            return self.gpu.run(fn, *args)
        if self._one_thread is not None:
            return self._one_thread.submit(fn, *args).result()
        return fn(*args)

    def _timed(self, x: tuple[Any, ...]) -> tuple[Any, Any, Any, torch.Tensor]:
        """A training forward between two marks of this stage's clock (on its stream), and
        whether its outputs are finite (StageBase.note_finite)."""
        start = self.times.clock.mark()
        y = self.compute(*x)
        end = self.times.clock.mark()
        return start, y, end, nonfinite.all_finite(y, quick=True)

    def _round_outputs(self, round: int, micro_batches: int) -> tuple[Any, Any]:
        """The last stage: forward round `round`'s outputs, its micro-batches' joined, and
        its labels, from the first stage's reader (asked for as its first micro-batch came)."""
        with self._record:
            outputs = [self._outputs.pop((round, mb)) for mb in range(micro_batches)]
            # A round that failed half-way leaves outputs and labels no loss will take.
            self._outputs = {k: v for k, v in self._outputs.items() if k[0] > round}
            labels = self._labels.pop(round)
            self._labels = {r: f for r, f in self._labels.items() if r > round}
        return join(outputs), batch_values.to(labels.wait(), self.device)

    def loss_backward(
        self,
        round: int,
        micro_batches: int,
        loss_fn: Loss,
        context_id: int,
        scale: float,
        step: int,
        unscale: float | None,
    ) -> tuple[torch.Tensor, float | None]:
        """The last stage: the loss of training round `round` (the mean over the whole
        batch, as in one process), the distributed backward from it times `scale`, and this
        stage settled (`settle`), in one call; with `unscale`, the norm of the step's
        gradients too (StageBase.norm). Only the loss's value crosses to the master."""
        outputs, labels = self._round_outputs(round, micro_batches)
        loss = self._on_device(loss_fn, outputs, labels).cpu()
        dist_autograd.backward(context_id, [loss * scale if scale != 1.0 else loss])
        self.settle(step, micro_batches)
        norm = None if unscale is None else self.norm(context_id, unscale)
        return loss.detach(), norm

    def tally(
        self,
        round: int,
        micro_batches: int,
        loss_fn: Callable[..., Any],
        tally: Tally,
    ) -> Tally:
        """The last stage: `tally` with evaluation round `round`'s figures added."""
        outputs, labels = self._round_outputs(round, micro_batches)
        self._on_device(tally.add, outputs, labels, loss_fn)
        return tally

    def _evaluate(self, x: tuple[Any, ...]) -> Any:
        with self.evaluating():
            return self.compute(*x)

    def _round_gradients(self, step: int, round: int) -> RoundGradients | None:
        """The sum of round `round`'s gradients here, kept by its distributed autograd
        context (each round has its own); those of earlier steps are forgotten. None outside
        a context (a stage called in one process), where autograd adds them to `.grad`."""
        context_id = current_context()
        if context_id is None:
            return None
        with self._record:
            self._sums = {c: s for c, s in self._sums.items() if s.step >= step}
            if context_id not in self._sums:
                buffers = self._sum_buffers.setdefault(round, {})
                self._sums[context_id] = RoundGradients(step, round, not self.last, buffers)
            sums = self._sums[context_id]
        if sums.round != round:
            raise RuntimeError(f"rounds {sums.round} and {round} ran in one autograd context")
        return sums

    def _time_backward(
        self, key: tuple[int, Any], y: Any, received: tuple[Any, ...], sums: RoundGradients | None
    ):
        """Backward through this shard starts when the gradient of its outputs arrives and
        ends when the autograd nodes nearest the shard's inputs have run; it is done once
        those and the nodes that send the gradient on to the previous stage have run. The
        parameters' gradients go to `sums` (gradient_sum.py)."""
        step, (round, micro_batch) = key
        roots = [t.grad_fn for t in tensors(y) if t.grad_fn is not None]
        if not roots:
            self._backward_done(key, sums)  # nothing of this micro-batch to backpropagate here
            return
        stops = {t.grad_fn for t in tensors(received) if t.grad_fn is not None}
        take = None if sums is None else lambda name, grad: sums.add(micro_batch, name, grad)
        ends = walk_backward(roots, stops, self._names, take)
        if micro_batch == 0:  # every backward of the rounds before has run
            self._backward_order.forget(round)
        for root in roots:
            # The last stage's one backward has an order of its own; on a GPU the roots run
            # on the device's one autograd thread, which must not wait: there the sums hold
            # what comes early (gradient_sum.py).
            if not self.last and self.gpu is None:
                root.register_prehook(lambda grads: self._backward_order.wait(round, micro_batch))
            root.register_prehook(lambda grads: self.times.note(key, "start"))
        left = [len(ends) + len(stops)]

        def ran(node_end: bool) -> None:
            if node_end:
                self.times.note(key, "end")
            with self._settled:
                left[0] -= 1
                if left[0] == 0:
                    self._backward_done(key, sums)

        for node in ends:
            node.register_hook(lambda grads_in, grads_out: ran(True))
        for node in stops:
            node.register_hook(lambda grads_in, grads_out: ran(False))

    def _backward_done(self, key: tuple[int, Any], sums: RoundGradients | None) -> None:
        if sums is not None:
            sums.done(key[1][1])
        self._backward_order.done(*key[1])
        with self._settled:
            self._done[key[0]] = self._done.get(key[0], 0) + 1
            self._settled.notify_all()

    def settle(self, step: int, micro_batches: int) -> None:
        """Wait until every micro-batch of `step` has backpropagated through this shard.

        The distributed backward (the last stage's, `loss_backward`) can return before that:
        when several gradients of one context reach a worker, torch waits only for the RPCs
        the first one started, so the gradient a later one sends on may still be on its way
        (and a context released then loses it). Every stage settles before the optimizer
        steps."""
        with self._settled:
            if not self._settled.wait_for(
                lambda: self._done.get(step, 0) >= micro_batches, rendezvous.RPC_TIMEOUT_SECONDS
            ):
                raise TimeoutError(
                    f"{self._done.get(step, 0)} of {micro_batches} micro-batches of step"
                    f" {step} backpropagated within {rendezvous.RPC_TIMEOUT_SECONDS:g}s"
                )
            self._done = {s: n for s, n in self._done.items() if s > step}

    def timings(self, step: int | None = None) -> dict[int, tuple[float, float, float]]:
        return self.times.timings(step)

    def gradients(self, context_id: int) -> dict[str, torch.Tensor]:
        """A round's gradients, by its distributed autograd context: those this stage added
        in order (gradient_sum.py), and any distributed autograd added itself."""
        grads = dist_autograd.get_gradients(context_id)
        arrived = {n: grads[p] for n, p in self.parameters_by_name.items() if p in grads}
        sums = self._sums.get(context_id)
        return arrived if sums is None else sums.merged(arrived)


@rpc.functions.async_execution
def passed_on(
    key: int,
    x: tuple[Any, ...],
    round: int,
    micro_batch: int,
    step: int | None,
    end: RoundEnd | None,
) -> Future:
    """Runs on the next stage's worker: `RpcStage.pass_on` of the RpcStage held there."""
    return held(key).pass_on(x, round, micro_batch, step, None, end)


def stage_devices(
    index: int, stages: list[str], gpus: int
) -> tuple[dict[str, dict[int, int]] | None, list[int] | None]:
    """RPC device maps and devices of stage `index`: with GPUs, its shard lives on cuda:0 and
    activations and gradients go GPU to GPU between neighbouring stages. The master stays
    CPU, so it needs no map."""
    if gpus <= 0:
        return None, None
    neighbours = [stages[j] for j in (index - 1, index + 1) if 0 <= j < len(stages)]
    return {name: {0: 0} for name in neighbours}, [0]
