"""The pipelining engine's step driver, on the master: for each round, the first stage reads
its batch and every stage of the replica runs the round through its torch schedule at once
(Stage.train); then the recipe, as on the rpc engine: tied weights' gradients summed, the
replicas' averaged, the global norm clipped, and each stage's optimizer stepped with the
learning rate of the step. What both engines' drivers share is pipeline/driver.py's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch.futures import Future

from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.trainer.pipeline import driver
from pipejob.trainer.pipeline.pipelining.stage import NO_CONTEXT, Finish, Stage
from pipejob.trainer.pipeline.reader import HELD_OUT, Reader, Source
from pipejob.trainer.pipeline.shards import Shards
from pipejob.trainer.pipeline.stage_calls import created_stages, remote_stage
from pipejob.trainer.pipeline.step_records import ReplicaShare, Round, RoundsRun, StepResult
from pipejob.trainer.runtime.optim import learning_rate
from pipejob.trainer.runtime.profiling import phase
from pipejob.trainer.workloads import Loss
from pipejob.trainer.workloads.metrics import Tally

Reply = tuple[float | None, float | None]  # a stage's to Stage.train: loss (the last's), norm


def outcome(replies: list[Reply], norms: bool) -> tuple[float, list[float] | None]:
    """A round's loss (the last stage's reply) and, where they were asked for, each stage's
    gradient norm."""
    loss = replies[-1][0]
    assert loss is not None
    return loss, [norm for _, norm in replies] if norms else None


@dataclass
class InFlight:
    """A step sent to the stages (Replicas.run_steps) whose replies are not yet read: its
    one training round's number and share of the batch, when it was sent and, where it was
    sent while the step before ran, when that one's replies were in."""

    step: int
    round: int
    share: float
    sent: float  # time.perf_counter()
    replies: list[Future[Reply]]
    follows: Future[float] | None

    def __post_init__(self) -> None:
        self.ended = torch.futures.collect_all(self.replies).then(lambda _: time.perf_counter())

    def began(self) -> float:
        """When its stages began it, as the master sees it."""
        return self.sent if self.follows is None else max(self.sent, self.follows.wait())

    def settle(self) -> None:
        """Wait for its replies, whatever they are: nothing sent is left running."""
        self.ended.wait()


def even(micro_batches: int, samples: int) -> int:
    """The micro-batches a PipelineStage runs a round of `samples` in: the most, up to its
    count (`micro_batches`, no more than its samples), of equal size (its buffers have one
    shape). A training batch's count divides it; a last, smaller held-out batch may run in
    fewer."""
    return max(n for n in range(1, micro_batches + 1) if samples % n == 0)


class Pipeline(driver.Pipeline):
    """The master's handle on one replica's stage processes: creates their Stages (each
    building its own pieces) and runs rounds through them."""

    def __init__(
        self,
        stage_names: list[str],
        shards: Shards,
        spec: PipelineSpec,
        device: str = "cpu",
        source: Source | None = None,
    ):
        processes = len(stage_names)
        args = [
            (
                shards.part(k) if shards.parts else shards.stages[k],
                k,
                processes,
                shards.process_pieces(k),
                spec.schedule,
                spec.optimizer,
                device,
                spec.precision,
                spec.activation_checkpointing,
                source if k == 0 else None,
            )
            for k in range(processes)
        ]
        super().__init__(stage_names, created_stages(stage_names, Stage, args))
        self.pieces = len(shards.ranges)
        self._learnt: set[tuple[bool, int, int]] = set()

    def learn(self, batch: Round, training: bool) -> None:
        """Before the first round of its kind: the shapes each piece takes and passes on, piece
        after piece from the first stage's inputs (Stage.learn)."""
        key = (training, even(batch.micro_batches, batch.samples), batch.samples)
        if key in self._learnt:
            return
        size = batch.samples // key[1]  # a micro-batch's samples, as the stages run them
        read = self.reader(Reader.metas, batch.number)
        metas = [((size, *shape[1:]), dtype) for shape, dtype in read]
        for piece in range(self.pieces):
            k = piece % len(self.stages)
            metas = remote_stage(self.names[k], self.stages[k]).result(
                Stage.learn, key, piece, metas
            )
        self._learnt.add(key)

    def reads_in_run(self, micro_batches: int, samples: int) -> bool:
        # Not before the shapes of such a round are learnt, on a round read first.
        return (True, even(min(micro_batches, samples), samples), samples) in self._learnt

    def launch(
        self,
        batch: Round,
        step: int,
        loss_fn: Loss,
        weight: float,
        unscale: float | None = None,
        read: int | None = None,
        finish: Finish | None = None,
        after: int | None = None,
    ) -> list[Future[Reply]]:
        """Sends training round `batch` of step `step` to every stage (Stage.train): its loss
        weighted by `weight` for the backward; with `unscale` (1 / fp16's loss scale), each
        stage's gradient norm after it, computed in the same call; `read`: the first stage
        reads the round first, as that many micro-batches (`read_round`); `finish` (with
        `unscale`): the stages finish the step themselves (Stage._finish); `after`: each
        stage runs it once round `after` has run there. The futures of the stages' replies."""
        self.learn(batch, True)
        runs = even(batch.micro_batches, batch.samples)
        last = len(self.stages) - 1  # holds the last piece (stage k is on process k % p)
        round_ = (batch.number, runs, batch.samples)  # as the stages run it
        return [
            remote_stage(name, stage).future(
                Stage.train,
                *round_,
                step,
                loss_fn if k == last else None,
                weight,
                unscale,
                read if k == 0 else None,
                finish,
                after,
            )
            for k, (name, stage) in enumerate(zip(self.names, self.stages, strict=True))
        ]

    def evaluate(self, micro_batches: int, limit: int, loss_fn: Loss, tally: Tally) -> Tally:
        """`tally` with the held-out set's figures (its first `limit` batches, all when 0):
        the first stage reads each batch, every stage runs its forwards, the last adds the
        figures (Stage.evaluate)."""
        self.reader(Reader.start_held_out, limit)
        last = len(self.stages) - 1
        while (batch := self.read(micro_batches, what=HELD_OUT)) is not None:
            self.learn(batch, False)
            runs = even(batch.micro_batches, batch.samples)
            tallies = torch.futures.wait_all(
                [
                    remote_stage(name, stage).future(
                        Stage.evaluate,
                        batch.number,
                        runs,
                        batch.samples,
                        loss_fn,
                        tally if k == last else None,
                    )
                    for k, (name, stage) in enumerate(zip(self.names, self.stages, strict=True))
                ]
            )
            tally = tallies[last]
        return tally


class Replicas(driver.Replicas):
    """Every copy of the pipeline, each stage with its own optimizer. With
    gradientAccumulation the rounds' gradients add up in .grad; then the replica's stages
    average them with the same stage of the other replicas (Shard.average_gradients), give
    their global norm, which clips them (gradients.py), and step."""

    zero_grad = True  # the gradients are in .grad

    def __init__(
        self, names: list[list[str]], shards: Shards, spec: PipelineSpec, device: str = "cpu"
    ):
        pipelines = [
            Pipeline(stage_names, shards, spec, device, Source(spec, r, len(names)))
            for r, stage_names in enumerate(names)
        ]
        super().__init__(pipelines, shards, spec)

    @property
    def runs_ahead(self) -> bool:
        """Whether a step may be sent before the last one's result is in: where the stages
        finish every step themselves (one pipeline, one round a step, no tied weights) and
        nothing of a step waits on the master's judgement of the last (fp16's loss scale)."""
        return (
            not self.tied
            and len(self.pipelines) == 1
            and self.accumulation == 1
            and self.loss_scale is None
        )

    def run_steps(self, micro_batches: int, steps: range, loss_fn: Loss) -> Iterator[StepResult]:
        """As driver.Replicas.run_steps; where the engine `runs_ahead`, each step is sent
        while the last runs, so the stages never wait for the master between steps (the
        master reads a step's result while the next one runs). A round whose shapes are not
        yet learnt is sent alone."""
        if not self.runs_ahead:
            yield from super().run_steps(micro_batches, steps, loss_fn)
            return
        pipeline = self.pipelines[0]
        sent: list[InFlight] = []  # the step running, and the next one
        try:
            for step in steps:
                if sent and not pipeline.reads_next_in_run(micro_batches):
                    yield self._landed(sent.pop())
                sent.append(self._send(micro_batches, step, loss_fn, sent[-1] if sent else None))
                if len(sent) == 2:
                    yield self._landed(sent.pop(0))
            while sent:
                yield self._landed(sent.pop(0))
        finally:
            for flight in sent:
                flight.settle()

    def _send(
        self, micro_batches: int, step: int, loss_fn: Loss, running: InFlight | None
    ) -> InFlight:
        """Step `step`'s one round, sent (after step `running`'s, where one runs)."""
        sent = time.perf_counter()
        pipeline = self.pipelines[0]
        round_, read = pipeline.read_round(micro_batches, None)
        share = self.share(round_, self.batch)
        after = None if running is None else running.round
        replies = pipeline.launch(
            round_, step, loss_fn, share, 1.0, read, self._finish(step), after
        )
        follows = None if running is None else running.ended
        return InFlight(step, round_.number, share, sent, replies, follows)

    def _landed(self, flight: InFlight) -> StepResult:
        """A sent step's result, once its replies are in. Its seconds run from when the
        stages began it to when they were done: stepping was part of their call."""
        pipeline = self.pipelines[0]
        loss, norms = outcome(torch.futures.wait_all(flight.replies), True)
        ran = RoundsRun([loss * flight.share], [flight.round], norms, flight.began())
        result = self.step_result(pipeline, NO_CONTEXT, flight.step, ran, stepped=True)
        seconds = flight.ended.wait() - ran.start
        return self.combined(
            flight.step, [replace(result, pipeline_seconds=seconds, optimizer_seconds=0.0)]
        )

    def _finish(self, step: int) -> Finish:
        """Step `step`'s clipping and learning rate, for stages that finish it themselves."""
        lr = learning_rate(self.optimizer, self.steps, step)
        return self.optimizer.clip_grad_norm, lr if self.optimizer.schedule is not None else None

    def _replica_result(self, part: ReplicaShare) -> StepResult:
        pipeline = self.pipelines[part.replica]
        rounds, step = part.rounds, part.step
        assert isinstance(pipeline, Pipeline)
        scale = 1.0 if self.loss_scale is None else self.loss_scale.scale
        weight = scale / len(rounds)  # each batch's share of the step's loss
        # Where nothing changes the gradients after the last round's backwards (no ties, no
        # other replica), its replies carry the stages' norms; where that round is the only
        # one (the stages see its loss alone), its call finishes the step too.
        early = not self.tied and len(self.pipelines) == 1
        stepped = early and len(rounds) == 1
        start = time.perf_counter()
        losses, numbers, norms = [], [], None
        for a, given in enumerate(rounds):
            with phase("read"):
                round_, read = pipeline.read_round(part.micro_batches, given)
            numbers.append(round_.number)
            share = self.share(round_, part.batch)
            unscale = self.unscale() if early and a == len(rounds) - 1 else None
            finish = self._finish(step) if stepped else None
            with phase("schedule"):
                replies = pipeline.launch(
                    round_, step, part.loss_fn, weight * share, unscale, read, finish
                )
                loss, norms = outcome(torch.futures.wait_all(replies), unscale is not None)
            losses.append(loss * share)
        ran = RoundsRun(losses, numbers, norms, start)
        return self.step_result(pipeline, NO_CONTEXT, step, ran, stepped)

    def activation_peaks(self) -> list[int] | None:
        return self.pipelines[0].stage_results(Stage.activation_peak)
