"""The pipelining engine's stage side: a stage process's pieces of the model as
torch.distributed.pipelining PipelineStages over its pipeline's process group, stepping the
job's torch schedule (schedules.py) a whole round, or several steps of a round each, per
call from the master. How a round runs and why each piece learns its shapes:
docs/architecture.md ("The pipelining engine")."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from pipejob.core.optimizer import Optimizer
from pipejob.trainer.pipeline import stage_groups
from pipejob.trainer.pipeline.pipelining import messages, schedules
from pipejob.trainer.pipeline.pipelining.activations import ActivationMeter
from pipejob.trainer.pipeline.pipelining.compute_marks import ComputeMarks
from pipejob.trainer.pipeline.pipelining.flat_piece import FlatPiece
from pipejob.trainer.pipeline.pipelining.step_finish import NO_CONTEXT, StepFinish
from pipejob.trainer.pipeline.pipelining.timed import Timed
from pipejob.trainer.pipeline.reader import Source
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.pipeline.stage_build import PieceBuilder
from pipejob.trainer.pipeline.step_records import RoundAsks
from pipejob.trainer.runtime import nonfinite
from pipejob.trainer.runtime.rendezvous import RPC_TIMEOUT_SECONDS
from pipejob.trainer.workloads import Loss
from pipejob.trainer.workloads.cut import join
from pipejob.trainer.workloads.metrics import Tally

Metas = list[tuple[tuple[int, ...], torch.dtype]]  # the shape and dtype of each value
Key = tuple[bool, int, int]  # a kind of round: training?, micro-batches, samples
StepReply = tuple[float | None, float | None, float]  # PipeliningStage.train's: loss, norm, seconds
METERED_ROUNDS = 2  # training rounds of each kind whose activations are counted


class PipeliningStage(StageBase):
    """Stage process `index` of its pipeline's `processes`: its pieces (built here from a
    `PieceBuilder`) as PipelineStages, the job's schedule over them, and the optimizer that steps
    them."""

    grads_in_place = True  # StageBase's: its gradients are in .grad

    def __init__(
        self,
        builder: PieceBuilder | nn.Module,
        index: int,
        processes: int,
        pieces: list[int],
        schedule: str,
        optimizer: Optimizer,
        device: str,
        precision: str = "fp32",
        recompute: bool = False,
        source: Source | None = None,
    ):
        super().__init__(builder, device, precision, recompute, source, optimizer)
        self.index, self.held, self.schedule = index, pieces, schedule
        self.count = processes * len(pieces)  # pieces in the pipeline
        self.pipeline, _, self.host = stage_groups.mine()  # its replicas group: Shard's
        self._taken = -1  # the last training round read here, its labels passed on
        # The call's next training round to read (its round, micro-batches, samples) once
        # the first piece waits for gradients (`waits`).
        self._next: tuple[int, int, int] | None = None
        self.first, self.last = 0 in pieces, self.count - 1 in pieces
        apart = not (self.first and self.last)  # the labels pass from the first to the last
        self._labels_out = messages.LabelsOut(self.host) if apart and self.first else None
        self._labels_in = messages.LabelsIn(self.host) if apart and self.last else None
        self.ends = StepFinish(self.host, self.last)  # its steps' ends (step_records.StepEnd)
        # A step's figures ride with its last backward's messages where a process holds one
        # piece: (that backward's micro-batch, fp16's unscale) in such a round (`ride_out`).
        self._rides = self.count > 1 and len(pieces) == 1 and schedule in schedules.SINGLE
        self._ride: tuple[int, float] | None = None
        self._rode: tuple[float, float | None] | None = None  # the norm and loss it sent
        self.modules = [
            FlatPiece(
                self.computed(piece, k == self.count - 1),
                k == self.count - 1,
                f"the end of stage {k}",
            )
            for k, piece in zip(pieces, self.pieces, strict=True)
        ]
        self.meter = ActivationMeter(self.layers.parameters())
        self._metered: dict[Key, int] = {}  # training rounds counted, per kind
        self._counting = False  # the meter counts this round's activations
        self._runs: dict[Key, tuple[Any, list[Timed]]] = {}
        self._metas: dict[tuple[Key, int], tuple[Metas, Metas]] = {}  # (in, out) per piece
        self._loss: tuple[Loss | None, float] | None = None  # the round's loss and its weight
        self._losses: list[torch.Tensor] = []
        self.marks = ComputeMarks(self.device)
        self._round = 0  # the training round running
        # Its forwards' outputs finite? Checked as it waits (`waits`) where it receives each
        # micro-batch's gradients (one piece a process), else at once.
        self._checks = nonfinite.RoundChecks(schedule in schedules.SINGLE)
        self._more = False  # another training round follows in the call
        self._ran = threading.Condition()
        self._last_ran = -1  # the last training round that ran here

    def learn(self, key: Key, piece: int, given: Metas) -> Metas:
        """What piece `piece` passes on in a round of kind `key` when given values of the
        shapes `given` (kept, for its PipelineStages): it runs once on zeros, in eval mode,
        without autograd, its random stream forked, so nothing it holds changes."""
        module = self.modules[self.held.index(piece)]
        values = [torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in given]
        with self.evaluating(), torch.random.fork_rng(devices=[]):
            out = module(*values)
        out = out if isinstance(out, tuple) else (out,)
        self._metas[key, piece] = given, [(tuple(t.shape), t.dtype) for t in out]
        return self._metas[key, piece][1]

    def _run(self, training: bool, micro_batches: int, samples: int) -> tuple[Any, list[Timed]]:
        """The schedule of a round of `samples` in `micro_batches` (training, or an
        evaluation's forward-only one) and its PipelineStages, made on first use, with the
        shapes its pieces learnt (`learn`)."""
        key = (training, micro_batches, samples)
        if key not in self._runs:
            stages = []
            for k, module in zip(self.held, self.modules, strict=True):
                given, passed = (_meta(m, training) for m in self._metas[key, k])
                stages.append(
                    Timed(
                        self,
                        module,
                        k,
                        self.count,
                        self.device,
                        input_args=given,
                        output_args=passed,
                        group=self.pipeline,
                    )
                )
            if training:
                run = schedules.training(self.schedule, stages, micro_batches, self._micro_loss)
            else:
                run = schedules.forward_only(stages, micro_batches)
            self._runs[key] = run, stages
        return self._runs[key]

    def _micro_loss(self, output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss, as the schedule asks for it on the last stage: the job's
        loss of the model's output, weighted for the step (1 / micro-batches, / rounds, x
        fp16's loss scale; a weight of 1 is no op, nor its backward)."""
        assert self._loss is not None and self._loss[0] is not None  # given to the last stage
        loss_fn, weight = self._loss
        with self.counting():
            loss = loss_fn(self.modules[-1].rebuild(output), target)
        self._losses.append(loss.detach())
        return loss if weight == 1.0 else loss * weight

    def train(
        self,
        round: int,
        micro_batches: int,
        samples: int,
        steps: range,
        loss_fn: Loss | None,
        weight: float,
        asks: list[RoundAsks],
        read: int | None = None,
        after: int | None = None,
    ) -> list[StepReply]:
        """Training rounds `round`, `round` + 1, ... of steps `steps`, one each: forwards and
        backwards of its `micro_batches` (of `samples` in all), the gradients added to
        .grad; `read`: the first stage reads each round first, as that many micro-batches
        (Reader.read); `asks`, per step, what its round's end asks (the norm; the step's
        tail too: `ends`, step_finish.py); `after`: once round `after` has run here
        (`_in_turn`). Per step: its loss on the last stage (the mean of its micro-batches';
        None elsewhere), where asked the norm of its gradients (StageBase.norm; else None),
        and its seconds here, from the end of the step before."""
        rounds = range(round, round + len(steps))
        replies: list[StepReply] = []
        with self._in_turn(rounds[-1], after):
            begun = time.perf_counter()
            for number, step, asked in zip(rounds, steps, asks, strict=True):
                self._more = number < rounds[-1]
                ahead = read is not None and self._more  # the next round read here, ahead
                self._next = (number + 1, read, samples) if ahead else None
                loss, norm = self._train_round(
                    number, micro_batches, samples, step, loss_fn, weight, read, asked
                )
                ended = time.perf_counter()
                replies.append((loss, norm, ended - begun))
                begun = ended
        return replies

    def _train_round(
        self,
        round: int,
        micro_batches: int,
        samples: int,
        step: int,
        loss_fn: Loss | None,
        weight: float,
        read: int | None,
        asks: RoundAsks,
    ) -> tuple[float | None, float | None]:
        """One round of `train`, in its turn."""
        if self.first and self._taken != round:
            self._take_round(round, read, samples)
        run, _ = self._run(True, micro_batches, samples)
        key = (True, micro_batches, samples)
        self._metered[key] = self._metered.get(key, 0) + 1
        self._counting = self._metered[key] <= METERED_ROUNDS
        args = (self.reader.inputs(round),) if self.first else ()
        target = self._last_labels(round) if self.last else None
        gathers = StepFinish.gathers(asks)
        riding = gathers and self._rides
        if gathers:  # posted now, so they are in when the backward ends
            self.ends.figures.expect(riding)
        self._loss, self._losses = (loss_fn, weight / micro_batches), []
        self._round = round
        self._checks = nonfinite.RoundChecks(self._checks.deferred)
        ride = riding and asks.unscale is not None  # it is where the figures gather
        self._ride = (micro_batches - 1, asks.unscale) if ride else None
        self.marks.begin(step, training=True)
        try:
            run.step(*args, target=target, return_outputs=False)
        finally:
            self._ride, rode, self._rode = None, self._rode, None
        self.note_finite(step, round, self._checks.joined())
        if rode is not None:
            norm, loss = rode
        else:
            norm = None if asks.unscale is None else self.norm(NO_CONTEXT, asks.unscale)
            loss = self._round_loss()
        self.ends.finish(self, asks, norm, loss)
        return loss, norm

    def _round_loss(self) -> float | None:
        """The round's loss on the last stage (the mean of its micro-batches'), else None."""
        if not self.last:
            return None
        one = len(self._losses) == 1  # the mean of one is itself, without two more ops
        return (self._losses[0] if one else torch.stack(self._losses).mean()).item()

    def ride_in(self, ops: list[Any], micro_batch: int) -> list[Any]:
        """A schedule's receives of `micro_batch`'s gradients, with those of the figures of
        the processes after this one where they ride with the round's last backward."""
        if self._ride is not None and micro_batch == self._ride[0] and not self.last:
            ops.append(self.ends.figures.below())
        return ops

    def ride_out(self, ops: list[Any], micro_batch: int) -> list[Any]:
        """A schedule's sends of `micro_batch`'s gradients; after the round's last backward,
        with this process's figures and those after it (its gradients are whole then)."""
        if self._ride is not None and micro_batch == self._ride[0] and not self.first:
            norm, loss = self.norm(NO_CONTEXT, self._ride[1]), self._round_loss()
            self._rode = norm, loss
            ops.append(self.ends.figures.up(self.ends.row(norm, loss)))
        return ops

    def _take_round(self, round: int, read: int | None, samples: int) -> None:
        """On the first stage process: training round `round` read (`read` None: given before
        the call), whole (its schedule splits it), its labels passed on to the last."""
        if read is not None:
            self.reader.read_planned(round, 1, samples)
        self._taken = round
        if self._labels_out is not None:
            self._labels_out.send(self.reader.labels(round))

    def _last_labels(self, round: int) -> torch.Tensor:
        """Training round `round`'s labels on the last stage process: from the first's
        reader (the next round's receive posted at once where the call runs one)."""
        if self._labels_in is None:
            got = self.reader.labels(round)
        else:
            got = self._labels_in.take()
            if self._more:
                self._labels_in.expect()
        # Contiguous, as torch 2.11's schedules check the strides of what they split.
        return got.to(self.device).contiguous()

    @contextmanager
    def _in_turn(self, round: int, after: int | None) -> Iterator[None]:
        """Training rounds up to `round`, once round `after` has run here (None: at once):
        the master sends a call before the last one's replies are in (PipeliningReplicas.run_steps),
        and this process's RPC threads may start the two calls in either order."""
        if after is not None:
            with self._ran:
                if not self._ran.wait_for(lambda: self._last_ran >= after, RPC_TIMEOUT_SECONDS):
                    raise TimeoutError(
                        f"training round {after} did not end here within"
                        f" {RPC_TIMEOUT_SECONDS:g}s (the last that did: {self._last_ran})"
                    )
        try:
            yield
        finally:
            self.marks.ended()
            with self._ran:
                self._last_ran = max(self._last_ran, round)
                self._ran.notify_all()

    def forwarded(self, output: Any) -> None:
        """A piece's forward gave `output`: in training, whether it is finite is checked
        (nonfinite.RoundChecks; joined and noted once the round has run, note_finite)."""
        if self.marks.step is not None:
            self._checks.add(output)

    def waits(self, piece: int, micro_batch: int) -> None:
        """Piece `piece` is about to wait for `micro_batch`'s gradients: what need not delay
        a send is done now: the outputs checked (on GPipe's last piece, only those whose
        backward was sent), and on the first piece the call's next round taken."""
        late = self.last and self.schedule == schedules.GPIPE  # every forward came first
        self._checks.check(micro_batch if late else None)
        if piece == 0 and self._next is not None:
            self._take_round(*self._next)
            self._next = None

    def evaluate(
        self,
        round: int,
        micro_batches: int,
        samples: int,
        loss_fn: Loss,
        tally: Tally | None,
    ) -> Tally | None:
        """Evaluation round `round`: forwards only, the shard in eval mode; the last stage
        returns `tally` with the round's figures added."""
        run, stages = self._run(False, micro_batches, samples)
        args = (self.reader.inputs(round),) if self.first else ()
        self.marks.begin(None)  # an evaluation's forwards are not the step's
        with self.evaluating():
            run.step(*args)
        if not self.last:
            return None
        assert tally is not None
        last = stages[-1]
        outputs = join([self.modules[-1].rebuild(chunk) for chunk in last.output_chunks])
        last.output_chunks.clear()
        tally.add(outputs, self.labels(round), loss_fn)
        return tally

    def gradients(self, context_id: int) -> dict[str, torch.Tensor]:
        """The step's gradients, in the parameters' .grad."""
        return {n: p.grad for n, p in self.parameters_by_name.items() if p.grad is not None}

    def zero_grad(self) -> None:
        """Forget the step's gradients (stepped, or skipped: fp16 overflowed)."""
        assert self.optimizer is not None
        self.optimizer.zero_grad()

    def counting(self) -> AbstractContextManager[None]:
        """Where the meter counts what autograd saves: in the first training rounds of each
        kind (METERED_ROUNDS); every later one holds the same, and its hooks cost a Python
        call per saved tensor."""
        return self.meter.counting() if self._counting else nullcontext()

    def activation_peak(self) -> int:
        """The most bytes of activations this stage has held for its backwards."""
        return self.meter.peak

    def timings(self, step: int | None = None) -> dict[int, tuple[float, float, float]]:
        return self.marks.timings(step)


def _meta(metas: Metas, training: bool) -> tuple[torch.Tensor, ...]:
    """Stand-ins of the values a PipelineStage takes or passes on; in training, floating ones
    carry gradients (torch sends a gradient back for those only)."""
    return tuple(
        torch.empty(
            shape, dtype=dtype, device="meta", requires_grad=training and dtype.is_floating_point
        )
        for shape, dtype in metas
    )
