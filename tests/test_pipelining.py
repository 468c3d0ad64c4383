"""The pipelining engine (spec.engine: pipelining): every torch schedule pipejob offers
computes one process's loss and gradients (float64, as jobrun.check_gradients), for the
transformer language model, ResNet-50 and a model whose tied weight the cut separates, in 2
to 4 stage processes, with replicas; each world runs every schedule on the same processes.
And a job as a user runs it, with replicas, evaluation, its model out and a restart that
resumes exactly; and steps sent ahead, each while the last runs, computing what steps one
after the other do."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from userdata import BYTE_VOCAB, write_stdlib_tokens

from harness.variants import exhaustive
from jobrun import (
    JobRun,
    assert_states_close,
    by_parameter,
    check_gradients,
    final_state,
    master_of,
    pipeline_job,
    run_to_end,
    run_world,
)
from pipejob.core import plan, spec
from pipejob.runner.local import LOOPBACK, free_ports
from pipejob.trainer import workloads
from pipejob.trainer.pipeline.balance import UnitCosts, measure_chain, min_max_partition, predict
from pipejob.trainer.pipeline.cut_model import piece_starts, plan_cut
from pipejob.trainer.pipeline.pipelining import messages
from pipejob.trainer.pipeline.pipelining.driver import PipeliningReplicas, even, outcome
from pipejob.trainer.pipeline.pipelining.stage import PipeliningStage
from pipejob.trainer.pipeline.pipelining.timed import Timed
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.pipeline.stage_build import CANDIDATES_PER_STAGE
from pipejob.trainer.pipeline.step_records import StepEnd
from pipejob.trainer.pipeline.train import runs
from pipejob.trainer.runtime import checkpoint, profiling
from pipejob.trainer.runtime.model_files import load_state_dict
from pipejob.trainer.workloads import cut, models

pytestmark = pytest.mark.timeout(400)

# As PipelineSpec fields: one stage per process, or two (the interleaved schedules).
SCHEDULES = [
    {"schedule": "gpipe", "stages_per_process": 1},
    {"schedule": "1f1b", "stages_per_process": 1},
    {"schedule": "interleaved-1f1b", "stages_per_process": 2},
    {"schedule": "zero-bubble", "stages_per_process": 2},
]
TRANSFORMER = {"vocabSize": BYTE_VOCAB, "layers": 3, "width": 32, "heads": 2, "seqLen": 32}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("stdlib-bytes") / "train.bin"
    write_stdlib_tokens(path, max_bytes=100_000)
    return str(path)


WORLDS: dict[str, tuple[dict[str, Any], int, int]] = {
    # name: the job's fields, stage processes, replicas
    "transformer": (
        {"model": {"transformer": TRANSFORMER}, "batchSize": 8, "microBatches": 2},
        2,
        2,
    ),
    "resnet50": ({"model": "resnet50", "batchSize": 8, "microBatches": 4}, 2, 1),
    "resnet18-4-stages": ({"model": "resnet18", "batchSize": 8, "microBatches": 4}, 4, 1),
    "tied-3-stages": (
        {
            "model": {"import": "userpkg.tied:tied_lm"},
            "data": {"import": "userpkg.brought:windows"},
            "batchSize": 6,
            "microBatches": 3,
        },
        3,
        1,
    ),
}


# The transformer (replicated) holds every schedule's exactness; the tied 3-stage world and
# the ResNets (BatchNorm, blocks) are `slow` variants.
@pytest.mark.parametrize("name", exhaustive(WORLDS, {"transformer"}))
def test_every_schedule_computes_one_process_gradients(
    name: str, tokens: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # userpkg for the processes
    fields, stages, replicas = WORLDS[name]
    if "transformer" in fields["model"]:
        fields = fields | {"data": {"tokens": {"train": tokens}, "workers": 1}}
    job = spec.parse(
        pipeline_job(
            f"pipelining-{name}",
            engine="pipelining",
            stages=stages,
            replicas=replicas,
            steps=1,
            **fields,
        )
    )
    got = check_gradients(job, tmp_path, timeout=360, schedules=SCHEDULES)
    assert len(got["stages"]) == 2 * stages  # the last schedule's pieces: two per process


def test_pieces_begin_only_where_the_model_passes_tensors():
    """The transformer's first block reads its input's shape first, so ints cross the cuts
    at blocks.0.norm1 and blocks.0.qkv (candidates once 4 pieces open that block): on the
    pipelining engine no piece begins there even where the cheapest split would, and a
    split point there is refused before any step; the rpc engine begins pieces anywhere."""
    fields = {"model": {"transformer": TRANSFORMER}, "stages": 2}
    four = {"schedule": "interleaved-1f1b", "stagesPerProcess": 2}
    job = spec.parse(pipeline_job("cuts", engine="pipelining", **fields, **four)).settings
    traced = cut.Traced(models.build(job), CANDIDATES_PER_STAGE * job.pieces)
    units, pieces = traced.units, traced.split(traced.units[1:])
    measured, _ = measure_chain(pieces, units, (torch.randint(0, 9, (2, 32)),), True, 1)
    assert measured.passes_tensors[:3] == [False, False, True]  # ints after embed and norm1
    seconds = [10.0 if u == "embed" else 1.0 for u in units]  # embed alone is cheapest
    costs = UnitCosts(seconds, seconds, None, measured.passes_tensors)
    anywhere = min_max_partition(costs.seconds, 4)
    assert units[anywhere[1].start] == "blocks.0.norm1"
    starts = piece_starts(job, units, costs, None)
    ranges = predict(costs, 2, 1, 8, per_process=2, starts=starts).ranges
    assert [units[r.start] for r in ranges] == [
        "embed",
        "blocks.0.proj",
        "blocks.0.norm2",
        "blocks.0.mlp.0",
    ]
    with pytest.raises(
        cut.CutError,
        match="passes other values .ints, tuples. where blocks.0.norm1, blocks.0.qkv begin:"
        " split elsewhere than blocks.0.qkv .spec.splitPoints.",
    ):
        piece_starts(job, units, costs, traced.ranges(["blocks.0.qkv", "blocks.1", "norm"]))
    rpc_job = spec.parse(pipeline_job("cuts", engine="rpc", **fields)).settings
    assert piece_starts(rpc_job, units, costs, None) is None


# ---------------------------------------------------------------- a job as a user runs it

INTERLEAVED_JOB = {
    "engine": "pipelining",
    "schedule": "interleaved-1f1b",
    "stagesPerProcess": 2,
    "stages": 2,
    "replicas": 2,
    "microBatches": 2,
    "gradientAccumulation": 2,
    "steps": 6,
    "seed": 1,
    "logEvery": 3,
    "preflight": {"megabytes": 0.5},
    "eval": {"everySteps": 3, "batches": 2},
    "optimizer": {
        "name": "sgd",
        "lr": 0.01,
        "momentum": 0.9,
        "clipGradNorm": 5.0,
        "schedule": {"warmupSteps": 2, "decay": "cosine", "minLr": 0.001},
    },
}


# slow: test_checkpoint.py resumes exactly; test_operator_e2e.py resumes this replicated
# pipelining world
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_with_replicas_evaluates_writes_its_model_and_resumes_exactly(tmp_path: Path):
    """ResNet-18 cut into 4 pieces on 2 stage processes (interleaved 1F1B), 2 replicas,
    accumulation, clipping and a schedule, evaluated and checkpointed: run through, and run
    again with a stage killed mid-way and the same manifest resumed. Both end with the same
    model and optimizer state, which the model file out holds under the model's names."""

    def job(name: str) -> dict[str, Any]:
        return pipeline_job(
            name,
            **INTERLEAVED_JOB,
            checkpoint={"path": str(tmp_path / name / "ck"), "everySteps": 2},
            output={"path": str(tmp_path / name / "model")},
        )

    with JobRun(job("straight"), tmp_path, "straight") as run:
        assert run.finish(300) == 0, run.output
        straight = run.summary()
    assert straight["engine"] == "pipelining" and straight["schedule"] == "interleaved-1f1b"
    assert straight["stagesPerProcess"] == 2 and straight["replicaDivergence"] == 0.0
    assert [len(st["layers"]) > 0 for st in straight["partition"]] == [True, True]
    assert all(st["peakActivationBytes"] > 0 for st in straight["partition"])
    assert [e["step"] for e in straight["evaluations"]] == [3, 6]
    assert "accuracy" in straight["evaluation"]

    with JobRun(job("broken"), tmp_path, "broken") as run:
        run.wait_for(r"^master\s*\| step 3/6 ", timeout=300)
        os.kill(run.pid("r1-stage1"), signal.SIGKILL)
        assert run.finish(60) != 0, run.output
    newest = checkpoint.latest(tmp_path / "broken" / "ck")
    assert newest is not None and newest.step in (2, 4)
    with JobRun(job("broken"), tmp_path, "broken") as run:
        assert run.finish(300) == 0, run.output
        output, resumed = run.output, run.summary()
    assert f"resumed from step {newest.step} (" in output
    assert resumed["losses"] == pytest.approx(straight["losses"][newest.step :], rel=1e-4)
    assert_states_close(
        by_parameter(final_state(tmp_path / "broken" / "ck", 6)),
        by_parameter(final_state(tmp_path / "straight" / "ck", 6)),
    )

    written = load_state_dict(tmp_path / "broken" / "model")
    model = models.build(spec.parse(job("broken")).settings)
    assert sorted(written) == sorted(model.state_dict())  # one file, the model's own names
    final = by_parameter(final_state(tmp_path / "broken" / "ck", 6))["stages"]["model"]
    for name, value in final.items():
        torch.testing.assert_close(written[name], value, msg=name)


@pytest.mark.slow  # two worlds: the held-out figures' arithmetic in process in test_any_model.py
@pytest.mark.timeout(400)
def test_an_evaluation_with_a_smaller_last_batch_says_what_the_rpc_engine_says(
    tmp_path: Path,
) -> None:
    """14 held-out windows in batches of 8 at 4 micro-batches: a last batch of 6, which the
    pipelining engine runs in 3 micro-batches of 2. Both engines evaluate the same model (a
    step of a vanishing learning rate) to the same figures."""
    val = tmp_path / "val.bin"
    write_stdlib_tokens(val, max_bytes=14 * TRANSFORMER["seqLen"] + 1, split="val")
    train = tmp_path / "train.bin"
    write_stdlib_tokens(train, max_bytes=20_000)
    figures = {}
    for engine in ("rpc", "pipelining"):
        job = pipeline_job(
            f"eval-{engine}",
            engine=engine,
            model={"transformer": TRANSFORMER},
            data={"tokens": {"train": str(train), "val": str(val)}},
            batchSize=8,
            microBatches=4,
            steps=1,
            eval={"batches": 0},
            optimizer={"name": "sgd", "lr": 1e-12},
        )
        code, out, summary = run_to_end(job, tmp_path, timeout=300)
        assert code == 0, out
        figures[engine] = summary["evaluation"]
    assert figures["pipelining"]["samples"] == figures["rpc"]["samples"] == 14
    for key in ("loss", "accuracy", "perplexity"):
        assert figures["pipelining"][key] == pytest.approx(figures["rpc"][key], rel=1e-5), key


# ---------------------------------------------------------------- steps sent ahead

AHEAD_STEPS = 6


EVENTS: list[str] = []  # on a stage process: its forwards' sends and the rounds it took


def _note_sends_and_takes() -> None:
    """Note, in EVENTS, each forward's sends (as the schedule asks for them, just before
    it posts them) and each training round the first stage takes (reads, its labels sent),
    with the parts its reader keeps the round's inputs in."""
    sends, take = Timed.get_fwd_send_ops, PipeliningStage._take_round

    def sending(piece: Timed, chunk: int) -> list[Any]:
        EVENTS.append(f"send {piece.owner._round}")
        return sends(piece, chunk)

    def taking(stage: PipeliningStage, round: int, *args: Any) -> None:
        take(stage, round, *args)
        parts = sum(1 for r, _ in stage.reader._inputs if r == round)
        EVENTS.append(f"take {round} in {parts}")

    Timed.get_fwd_send_ops, PipeliningStage._take_round = sending, taking  # type: ignore[method-assign]


def _events(clear: bool = False) -> list[str]:
    """On a stage process: EVENTS (then forgotten, with `clear`)."""
    got = list(EVENTS)
    if clear:
        EVENTS.clear()
    return got


def _ahead_world(rank: int, envs: list[dict[str, str]], out: str) -> None:
    """The master drives the same job twice on the same stage processes, from the same
    start: a step after the last one's result (PipeliningReplicas.step), and sent ahead in calls of
    several steps (PipeliningReplicas.run_steps, its calls unbounded in time), noting when it sent
    each call and read its results; then on GPipe, noting on the first stage when it
    takes each round."""
    _note_sends_and_takes()
    if (env := master_of(rank, envs)) is None:
        return
    try:
        s, names = env.spec, env.names("stage")
        cut_model = plan_cut(s, *models.build_meta(s), names)
        loss = workloads.loss(s)
        one_by_one = PipeliningReplicas([names], cut_model, s)
        stepped = [one_by_one.step(s.micro_batches, k, loss) for k in range(AHEAD_STEPS)]
        ahead = PipeliningReplicas([names], cut_model, s)
        ahead.call_seconds = math.inf
        order: list[str] = []
        send, land = ahead._send, ahead._landed
        ahead._send = lambda m, steps, *a: order.append(f"send {[*steps]}") or send(m, steps, *a)
        ahead._landed = lambda flight: order.append(f"read {[*flight.steps]}") or land(flight)
        sent = list(ahead.run_steps(s.micro_batches, range(AHEAD_STEPS), loss))
        # Unclipped, each stage steps by its own figures (StepEnd.ALONE); clipped at a norm
        # never reached, they wait for every stage's, as above: the same steps either way.
        unclipped, never = (
            dataclasses.replace(s, optimizer=dataclasses.replace(s.optimizer, clip_grad_norm=c))
            for c in (None, 1e9)
        )
        pairs = [PipeliningReplicas([names], cut_model, spec) for spec in (unclipped, never)]
        run = [list(r.run_steps(s.micro_batches, range(AHEAD_STEPS), loss)) for r in pairs]
        figures = [[(r.loss, r.grad_norm, r.lr) for r in rs] for rs in (stepped, sent, *run)]
        done = (one_by_one, ahead, *pairs)
        prints = [r.pipelines[0].stage_results(StageBase.fingerprint) for r in done]
        alone = [r.end is StepEnd.ALONE for r in done]
        rpc.rpc_sync(names[0], _events, args=(True,))
        gpipe = PipeliningReplicas(
            [names], cut_model, dataclasses.replace(unclipped, schedule="gpipe")
        )
        gpipe.call_seconds = math.inf
        list(gpipe.run_steps(s.micro_batches, range(AHEAD_STEPS), loss))
        got = {"figures": figures, "prints": prints, "order": order, "alone": alone}
        torch.save(got | {"events": rpc.rpc_sync(names[0], _events)}, out)
    finally:
        rpc.shutdown()


def test_steps_sent_ahead_compute_what_steps_one_after_the_other_do(tmp_path: Path):
    """The pipelining engine's master sends a call of steps while the last one runs: the
    first step alone (its shapes are learnt in it), the second before the first's result is
    read (its seconds are not yet known), then every step left in one call; and the losses,
    gradient norms, learning rates and weights are those of the same steps run one after
    the other, bit for bit (momentum, clipping and a schedule). Unclipped, each stage steps
    once its own backwards have run (StepEnd.ALONE), computing what stages
    that wait for every stage's figures compute."""
    job = spec.parse(
        pipeline_job(
            "ahead",
            model={"transformer": TRANSFORMER},
            engine="pipelining",
            schedule="1f1b",
            stages=2,
            batchSize=4,
            microBatches=2,
            steps=AHEAD_STEPS,
            optimizer={
                "name": "sgd",
                "lr": 0.05,
                "momentum": 0.9,
                "clipGradNorm": 0.5,
                "schedule": {"warmupSteps": 2},
            },
        )
    )
    envs = [p.env for p in plan.plan_world(job, lambda m: LOOPBACK, plan.Ports(*free_ports(2)))]
    got = run_world(_ahead_world, envs, tmp_path / "ahead.pt", timeout=200)
    rest = [*range(2, AHEAD_STEPS)]
    assert got["order"] == [
        "send [0]",
        "send [1]",
        "read [0]",
        f"send {rest}",
        "read [1]",
        f"read {rest}",
    ]
    stepped, sent, alone, judged = got["figures"]
    assert sent == stepped and len({loss for loss, _, _ in sent}) == AHEAD_STEPS
    assert got["alone"] == [False, False, True, False]  # clipping needs every stage's norm
    assert alone == judged and len({lr for _, _, lr in alone}) > 1  # warming up
    one_by_one, ahead, alone_prints, judged_prints = got["prints"]
    for a, b in zip(one_by_one, ahead, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(alone_prints, judged_prints, strict=True):
        assert torch.equal(a, b)
    # On GPipe the first stage takes a call's next round as it waits for gradients, once its
    # forwards are sent: not between its last forward and that forward's send. Rounds read
    # in a call are kept whole (the schedule splits them), the first, read before, in parts.
    rounds = sorted({int(e.split()[1]) for e in got["events"]})
    assert len(rounds) == AHEAD_STEPS
    parts = {r: 2 if r == rounds[0] else 1 for r in rounds}
    assert got["events"] == [
        e for r in rounds for e in (f"take {r} in {parts[r]}", f"send {r}", f"send {r}")
    ]


LABELS = [
    torch.arange(6),
    torch.rand(2, 3, 4, generator=torch.Generator().manual_seed(0)),  # alike in every process
    torch.tensor([True, False]),
    torch.ones(1).half(),
    torch.tensor(7, dtype=torch.int8),  # no dimensions
    torch.arange(messages.ROOM // 8 + 1),  # more than a receive posted ahead holds
    torch.zeros(0, 3, dtype=torch.bfloat16),
]
FIGURES = [[0.0, math.nan], [1.0, 2.5], [2.0, math.inf]]  # each process's


def _messages_world(rank: int, envs: list[dict[str, str]], out: str) -> None:
    """Three stage processes' gloo group: the first passes LABELS to the last (and refuses
    complex ones), which posts every other receive ahead; each gathers every one's FIGURES
    twice, the second time with its receives posted ahead."""
    address = f"tcp://{LOOPBACK}:{envs[0]['port']}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=len(envs))
    try:
        group = dist.new_group(list(range(len(envs))))
        said: Any = None
        if rank == 0:
            sent = messages.LabelsOut(group)
            for labels in LABELS:
                sent.send(labels)
            with pytest.raises(ValueError) as refused:
                sent.send(torch.zeros(2, dtype=torch.complex64))
            said = str(refused.value)
        elif rank == len(envs) - 1:
            taken = messages.LabelsIn(group)
            said = []
            for k in range(len(LABELS)):
                if k % 2:
                    taken.expect()
                said.append(taken.take().clone())
        figures = messages.StepFigures(group, 2)
        gathered = [figures.gather(FIGURES[rank])]
        figures.expect()
        gathered.append(figures.gather(FIGURES[rank]))
        # Riding with a schedule's last backward: the rows after a process's come with the
        # messages it receives from the next one, and go on, its own added, with those it
        # sends back to the one before (stage.ride_in, stage.ride_out).
        figures.expect(riding=True)
        if rank < len(envs) - 1:
            for work in dist.batch_isend_irecv([figures.below()]):
                work.wait()
        if rank > 0:
            for work in dist.batch_isend_irecv([figures.up(FIGURES[rank])]):
                work.wait()
        gathered.append(figures.gather(FIGURES[rank]))
        every: list[Any] = [None] * len(envs)
        dist.all_gather_object(every, (said, gathered))
        if rank == 0:
            torch.save(every, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_stage_processes_pass_labels_and_gather_figures_in_messages(tmp_path: Path):
    """What a pipeline's stage processes tell each other besides the schedule's activations
    (pipelining/messages.py), over a real gloo group of three: a round's labels of any
    dtype and shape, larger than a receive posted ahead holds too, reach the last process
    as they were, whether its receive was posted ahead or not; labels no message carries are
    refused by name; and every process gathers every one's figures, NaN and inf as they
    are, in rank order, whether they ride with a schedule's messages up the pipeline or
    not."""
    port = free_ports(1)[0]
    every = run_world(_messages_world, [{"port": str(port)}] * 3, tmp_path / "m.pt", timeout=100)
    (refusal, _), _, (taken, _) = every
    assert "torch.complex64 of 1 dimensions" in refusal
    assert len(taken) == len(LABELS)
    for got, sent in zip(taken, LABELS, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
    for _, gathered in every:
        for rows in gathered:
            torch.testing.assert_close(
                rows, torch.tensor(FIGURES, dtype=torch.float64), equal_nan=True
            )


def test_the_loop_runs_steps_back_to_back_up_to_a_checkpoint_an_evaluation_or_a_profile():
    """The master's loop sends steps ahead within a run (train.runs): a run ends after a step
    that a checkpoint or an evaluation follows, and a profiled step runs alone."""
    job = spec.parse(
        pipeline_job(
            "runs",
            steps=12,
            checkpoint={"path": "/tmp/unused", "everySteps": 5},
            eval={"everySteps": 4},
        )
    ).settings
    profile = profiling.ProfileSettings(frozenset({7}), Path("/tmp/unused"), 10)
    spans = [(r.start, r.stop) for r in runs(job, 0, profile, evaluates=True)]
    assert spans == [(0, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 10), (10, 12)]
    # Without an evaluation or a profile, from a resumed step 3.
    spans = [(r.start, r.stop) for r in runs(job, 3, None, evaluates=False)]
    assert spans == [(3, 5), (5, 10), (10, 12)]


def test_a_round_runs_in_equal_micro_batches():
    """A PipelineStage's buffers have one shape: a last, smaller held-out batch that its
    count does not divide runs in the most equal micro-batches below it."""
    assert [even(m, samples) for m, samples in [(4, 32), (4, 10), (4, 3), (8, 7), (2, 2)]] == [
        4,
        2,
        3,
        7,
        2,
    ]


def test_a_step_lasts_what_it_lasts_on_the_first_stage_process():
    """A step's seconds are the first stage process's, where each step begins and ends, so
    that the steps' seconds add up to the run's time: taking each step's slowest stage
    counted every stage's jitter (1-14% more than the wall time, docs/user-guide.md)."""
    first, middle, last = (None, 1.0, 0.010), (None, 2.0, 0.013), (0.5, 3.0, 0.011)
    assert outcome([first, middle, last]) == (0.5, [1.0, 2.0, 3.0], 0.010)
    assert outcome([(None, None, 0.02), (0.25, None, 0.03)]) == (0.25, None, 0.02)
