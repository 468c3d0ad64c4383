"""The pipelining engine's step driver, on the master: for each round, the first stage reads
its batch and every stage of the replica runs the round through its torch schedule at once
(PipeliningStage.train); then the recipe, as on the rpc engine: tied weights' gradients summed, the
replicas' averaged, the global norm clipped, and each stage's optimizer stepped with the
learning rate of the step, or, where the stages finish each step themselves, several steps
in one call. What both engines' drivers share is pipeline/driver.py's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch.futures import Future

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline import driver
from pipejob.trainer.pipeline.cut_model import CutModel
from pipejob.trainer.pipeline.pipelining.stage import NO_CONTEXT, PipeliningStage, StepReply
from pipejob.trainer.pipeline.reader import HELD_OUT, Reader, Source
from pipejob.trainer.pipeline.stage_base import MOST_STEPS_A_CALL
from pipejob.trainer.pipeline.stage_calls import created_stages, remote_stage
from pipejob.trainer.pipeline.step_records import (
    EngineEnds,
    ReplicaShare,
    Round,
    RoundAsks,
    RoundsRun,
    StepResult,
)
from pipejob.trainer.runtime.profiling import phase
from pipejob.trainer.workloads import Loss
from pipejob.trainer.workloads.metrics import Tally


def outcome(replies: list[StepReply]) -> tuple[float, list[float] | None, float]:
    """A step's round's loss (the last stage's), each stage's gradient norm (None where
    they were not asked for) and its seconds on the first stage process, from the stages'
    replies. The first process begins each step and ends it (the first piece's last
    backward): its steps' seconds add up to its wall time, where each step's slowest
    stage's added up to more (every stage's jitter counted, never evened out)."""
    loss = replies[-1][0]
    assert loss is not None
    norms = [norm for _, norm, _ in replies if norm is not None]
    return loss, norms if len(norms) == len(replies) else None, replies[0][2]


@dataclass
class InFlight:
    """Steps sent to the stages in one call each (PipeliningStage.train) whose replies are not yet
    read: the steps, their first training round and their share of the batch."""

    steps: range
    round: int
    share: float
    replies: list[Future[list[StepReply]]]

    @property
    def last_round(self) -> int:
        return self.round + len(self.steps) - 1

    def settle(self) -> None:
        """Wait for its replies, whatever they are: nothing sent is left running."""
        torch.futures.collect_all(self.replies).wait()


def even(micro_batches: int, samples: int) -> int:
    """The micro-batches a PipelineStage runs a round of `samples` in: the most, up to its
    count (`micro_batches`, no more than its samples), of equal size (its buffers have one
    shape). A training batch's count divides it; a last, smaller held-out batch may run in
    fewer."""
    return max(n for n in range(1, micro_batches + 1) if samples % n == 0)


class PipeliningPipeline(driver.PipelineBase):
    """The master's handle on one replica's stage processes: creates their Stages (each
    building its own pieces) and runs rounds through them."""

    def __init__(
        self,
        stage_names: list[str],
        cut_model: CutModel,
        spec: PipelineSpec,
        device: str = "cpu",
        source: Source | None = None,
    ):
        processes = len(stage_names)
        args = [
            (
                cut_model.builder(k) if cut_model.builders else cut_model.stages[k],
                k,
                processes,
                cut_model.process_pieces(k),
                spec.schedule,
                spec.optimizer,
                device,
                spec.precision,
                spec.activation_checkpointing,
                source if k == 0 else None,
            )
            for k in range(processes)
        ]
        super().__init__(created_stages(stage_names, PipeliningStage, args))
        self.pieces = len(cut_model.ranges)
        self._learnt: set[tuple[bool, int, int]] = set()

    def learn(self, batch: Round, training: bool) -> None:
        """Before the first round of its kind: the shapes each piece takes and passes on, piece
        after piece from the first stage's inputs (PipeliningStage.learn)."""
        key = (training, even(batch.micro_batches, batch.samples), batch.samples)
        if key in self._learnt:
            return
        size = batch.samples // key[1]  # a micro-batch's samples, as the stages run them
        read = self.reader(Reader.metas, batch.number)
        metas = [((size, *shape[1:]), dtype) for shape, dtype in read]
        for piece in range(self.pieces):
            metas = remote_stage(self.stages[piece % len(self.stages)]).result(
                PipeliningStage.learn, key, piece, metas
            )
        self._learnt.add(key)

    def reads_in_run(self, micro_batches: int, samples: int) -> bool:
        # Not before the shapes of such a round are learnt, on a round read first.
        return (True, even(min(micro_batches, samples), samples), samples) in self._learnt

    def launch(
        self,
        batch: Round,
        steps: range,
        loss_fn: Loss,
        weight: float,
        asks: list[RoundAsks],
        read: int | None = None,
        after: int | None = None,
    ) -> list[Future[list[StepReply]]]:
        """Sends `steps`, one training round each from round `batch` on, to every stage in
        one call (PipeliningStage.train): each loss weighted by `weight` for the backward;
        `asks`, per step, what its round's end asks of the stages (the norms, the step
        finished there: ReplicasBase.asks); `read`: the first stage reads each round first,
        as that many micro-batches (`read_round`); `after`: they run them once round `after`
        has run there. The futures of the stages' replies."""
        self.learn(batch, True)
        runs = even(batch.micro_batches, batch.samples)
        last = len(self.stages) - 1  # holds the last piece (stage k is on process k % p)
        return [
            remote_stage(stage).future(
                PipeliningStage.train,
                batch.number,
                runs,
                batch.samples,
                steps,
                loss_fn if k == last else None,
                weight,
                asks,
                read if k == 0 else None,
                after,
            )
            for k, stage in enumerate(self.stages)
        ]

    def evaluate(self, micro_batches: int, limit: int, loss_fn: Loss, tally: Tally) -> Tally:
        """`tally` with the held-out set's figures (its first `limit` batches, all when 0):
        the first stage reads each batch, every stage runs its forwards, the last adds the
        figures (PipeliningStage.evaluate)."""
        self.reader(Reader.start_held_out, limit)
        last = len(self.stages) - 1
        while (batch := self.read(micro_batches, what=HELD_OUT)) is not None:
            self.learn(batch, False)
            runs = even(batch.micro_batches, batch.samples)
            tallies = torch.futures.wait_all(
                [
                    remote_stage(stage).future(
                        PipeliningStage.evaluate,
                        batch.number,
                        runs,
                        batch.samples,
                        loss_fn,
                        tally if k == last else None,
                    )
                    for k, stage in enumerate(self.stages)
                ]
            )
            tally = tallies[last]
        return tally


class PipeliningReplicas(driver.ReplicasBase):
    """Every copy of the pipeline, each stage with its own optimizer. With
    gradientAccumulation the rounds' gradients add up in .grad; then the replica's stages
    average them with the same stage of the other replicas (StageBase.average_gradients), give
    their global norm, which clips them (gradients.py), and step."""

    zero_grad = True  # the gradients are in .grad
    # The rounds add up in .grad; the stages gather the step's figures in messages and step
    # by them, or each by its own (PipeliningStage.ends: step_finish.StepFinish).
    engine_ends = EngineEnds(rounds_add_in_place=True, finishes_scaled=True, steps_alone=True)
    call_seconds = 0.5  # about the longest a call of several steps runs (PipeliningStage.train)

    def __init__(
        self, names: list[list[str]], cut_model: CutModel, spec: PipelineSpec, device: str = "cpu"
    ):
        pipelines = [
            PipeliningPipeline(stage_names, cut_model, spec, device, Source(spec, r, len(names)))
            for r, stage_names in enumerate(names)
        ]
        super().__init__(pipelines, cut_model, spec)
        self._seconds: float | None = None  # the latest step's, sent ahead

    @property
    def runs_ahead(self) -> bool:
        """Whether a step may be sent before the last one's result is in: where the stages
        finish every step themselves (`end`) and nothing of a step waits on the master's
        judgement of the last (fp16's loss scale)."""
        return self.end.stepped_by_stages and self.loss_scale is None

    def run_steps(self, micro_batches: int, steps: range, loss_fn: Loss) -> Iterator[StepResult]:
        """As driver.ReplicasBase.run_steps; where the engine `runs_ahead`, several steps go to
        the stages in one call (`_call_steps`), and each call is sent while the last runs, so
        the stages never wait for the master between steps (the master reads a call's
        results while the next one runs). A round whose shapes are not yet learnt is sent
        alone."""
        if not self.runs_ahead:
            yield from super().run_steps(micro_batches, steps, loss_fn)
            return
        pipeline = self.pipelines[0]
        sent: list[InFlight] = []  # the call running, and the next one
        try:
            while (at := sent[-1].steps.stop if sent else steps.start) < steps.stop:
                alone = not pipeline.reads_next_in_run(micro_batches)
                if sent and alone:
                    yield from self._landed(sent.pop())
                call = range(at, min(steps.stop, at + (1 if alone else self._call_steps())))
                sent.append(self._send(micro_batches, call, loss_fn, sent[-1] if sent else None))
                if len(sent) == 2:
                    yield from self._landed(sent.pop(0))
            while sent:
                yield from self._landed(sent.pop(0))
        finally:
            for flight in sent:
                flight.settle()

    def _call_steps(self) -> int:
        """How many steps the next call runs: those that last about `call_seconds` at the
        latest step's seconds (a call's results come together), up to the stages' most; one
        before a step's seconds are known."""
        if self._seconds is None:
            return 1
        return max(1, int(min(self.call_seconds / self._seconds, MOST_STEPS_A_CALL)))

    def _send(
        self, micro_batches: int, steps: range, loss_fn: Loss, running: InFlight | None
    ) -> InFlight:
        """Steps `steps`, a round each, sent in one call (after the call `running`, where one
        runs)."""
        pipeline = self.pipelines[0]
        rounds = [pipeline.read_round(micro_batches, None) for _ in steps]
        first, read = rounds[0]
        share = self.share(first, self.batch)
        after = None if running is None else running.last_round
        asks = [self.asks(step, True) for step in steps]
        replies = pipeline.launch(first, steps, loss_fn, share, asks, read, after)
        return InFlight(steps, first.number, share, replies)

    def _landed(self, flight: InFlight) -> Iterator[StepResult]:
        """A call's steps' results, once its replies are in. A step's seconds are the first
        stage process's, from the step before to its end there (`outcome`): stepping was
        part of it."""
        pipeline = self.pipelines[0]
        replies = torch.futures.wait_all(flight.replies)
        for k, step in enumerate(flight.steps):
            loss, norms, seconds = outcome([stage[k] for stage in replies])
            ran = RoundsRun([loss * flight.share], [flight.round + k], norms, time.perf_counter())
            result = self.step_result(pipeline, NO_CONTEXT, step, ran)
            self._seconds = seconds
            yield self.combined(
                step, [replace(result, pipeline_seconds=seconds, optimizer_seconds=0.0)]
            )

    def _replica_result(self, replica_share: ReplicaShare) -> StepResult:
        pipeline = self.pipelines[replica_share.replica]
        rounds, step = replica_share.rounds, replica_share.step
        assert isinstance(pipeline, PipeliningPipeline)
        scale = 1.0 if self.loss_scale is None else self.loss_scale.scale
        weight = scale / len(rounds)  # each batch's share of the step's loss
        start = time.perf_counter()
        losses, numbers, norms = [], [], None
        for a, given in enumerate(rounds):
            with phase("read"):
                round_, read = pipeline.read_round(replica_share.micro_batches, given)
            numbers.append(round_.number)
            share = self.share(round_, replica_share.batch)
            asks = [self.asks(step, a == len(rounds) - 1)]
            with phase("schedule"):
                replies = pipeline.launch(
                    round_, range(step, step + 1), replica_share.loss_fn, weight * share, asks, read
                )
                loss, norms, _ = outcome([r[0] for r in torch.futures.wait_all(replies)])
            losses.append(loss * share)
        ran = RoundsRun(losses, numbers, norms, start)
        return self.step_result(pipeline, NO_CONTEXT, step, ran)

    def activation_peaks(self) -> list[int] | None:
        return self.pipelines[0].stage_results(PipeliningStage.activation_peak)
