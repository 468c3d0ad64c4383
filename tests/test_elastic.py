"""Checkpoints that reshard: a run stopped at step k and resumed on another shape (another
stage count, replica count, micro-batch count or engine; a HybridJob's trainer count or
parameter-server count) trains steps k+1
on exactly as a run of that shape does from the start, in float64, and reads on exactly where
the stopped run's world stopped: every sample once, none skipped (tests/userpkg/recorded.py
records what each process reads).

"Stopped at step k": a run of the first shape to the end, keeping only its checkpoint of step
k, is the world that stopped there (a later step's files would not be read anyway). An
elastic size ({min, max}) keeps the batch at every size, so one manifest serves both shapes
of a pair, run with `pipejob run --size`."""

from __future__ import annotations

import os
import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from jobrun import TOLERANCE, JobRun, pipeline_job
from pipejob.core import plan, spec
from pipejob.core.contract import ExitCode
from pipejob.runner.local import LOOPBACK, free_ports
from pipejob.trainer.pipeline.run_plan import saved_partition
from pipejob.trainer.runtime import checkpoint, world
from pipejob.trainer.workloads import models
from pipejob.trainer.workloads.data import StreamSampler
from pipejob.trainer.workloads.samples import order
from pipejob.trainer.workloads.synthetic import share_of

pytestmark = pytest.mark.timeout(600)
TESTS = Path(__file__).parent  # holds userpkg/, brought by `import:` as a user's package
STEPS, K = 4, 2  # steps of every run, and the step the stopped run's checkpoint is of
SIZE, BATCH = 40, 4  # samples of the recorded images; batchSize (per replica at replicas.max)


@pytest.fixture(autouse=True)
def userpkg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    )


def reads(folder: Path) -> dict[str, list[int]]:
    """Per reading process, the training samples it read, in order."""
    found: dict[str, list[int]] = defaultdict(list)
    for path in folder.glob("*.reads"):
        for line in path.read_text().splitlines():
            split, index = line.split()
            if split == "train":
                found[path.stem].append(int(index))
    return found


class Runs:
    """Each shape's uninterrupted run, once per test session (several pairs share them)."""

    def __init__(self, root: Path):
        self.root = root
        self.done: dict[str, dict[str, Any]] = {}

    def full(self, shape: str, manifest: dict[str, Any], size: int) -> dict[str, Any]:
        if shape not in self.done:
            self.done[shape] = run(manifest, self.root / shape, size)
        return self.done[shape]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("uninterrupted"))


# The tests that share an uninterrupted run go to one worker under pytest-xdist, which makes
# each run once (a module's fixture is made once per worker).
SHARES_RUNS = pytest.mark.xdist_group("elastic-runs")


def run(manifest_of: Any, directory: Path, size: int, root: Path | None = None) -> dict[str, Any]:
    """`pipejob run --size` of the manifest `manifest_of(checkpoint root, reads folder)` to
    its end; its summary, checkpoint root and reads."""
    directory.mkdir(parents=True, exist_ok=True)
    folder, root = directory / "reads", root or directory / "ckpt"
    folder.mkdir()
    with JobRun(manifest_of(root, folder), directory, args=("--size", str(size))) as job:
        assert job.finish(400) == 0, job.output
        summary, output = job.summary(), job.output
    return {"summary": summary, "root": root, "reads": reads(folder), "output": output}


def stopped_at_k(full: dict[str, Any], root: Path) -> Path:
    """A checkpoint root holding only the full run's checkpoint of step K."""
    shutil.copytree(checkpoint.step_dir(full["root"], K), checkpoint.step_dir(root, K))
    return root


def assert_losses_close(got: list[float], expected: list[float]) -> None:
    assert len(got) == len(expected) and got == pytest.approx(expected, rel=TOLERANCE)


# ------------------------------------------------------------------ PipelineJob


def pipeline(stages: int, micro_batches: int, engine: dict[str, Any] | None = None) -> Any:
    """`engine`: spec.engine and its fields (the rpc engine's when None; the default,
    engine auto, when {})."""

    def manifest(root: Path, folder: Path) -> dict[str, Any]:
        return pipeline_job(
            "elastic",
            **({"engine": "rpc"} if engine is None else engine),
            stages=stages,
            microBatches=micro_batches,
            batchSize=BATCH,
            steps=STEPS,
            replicas={"min": 1, "max": 2},
            seed=3,
            logEvery=1,
            preflight={"megabytes": 0.25},
            model={"import": "userpkg.recorded:mlp", "args": {"classes": 10}},
            data={
                "import": "userpkg.recorded:recorded",
                "args": {"folder": str(folder), "size": SIZE},
                "workers": 0,
            },
            optimizer={
                "name": "adamw",
                "lr": 0.01,
                "weightDecay": 0.01,
                "schedule": {"warmupSteps": 1, "decay": "linear"},
            },
            checkpoint={"path": str(root), "everySteps": K},
        )

    return manifest


# The pipelining engine, each stage process holding 2 pieces: 4 pieces in all.
INTERLEAVED = {"engine": "pipelining", "schedule": "interleaved-1f1b", "stagesPerProcess": 2}
# name: (stages, micro-batches, replicas, engine)
SHAPES = {
    "2x1m2": (2, 2, 1, None),
    "3x1m2": (3, 2, 1, None),
    "2x2m2": (2, 2, 2, None),
    "2x1m4": (2, 4, 1, None),
    "2x1m2-interleaved": (2, 2, 1, INTERLEAVED),
    "2x1m2-default": (2, 2, 1, {}),  # engine auto: pipelining here, rpc on an rpc cut
}
# `make test` resumes across engines and piece counts (2 pieces on rpc to 4 on interleaved
# pipelining); the other pairs are `slow` (tests/README.md).
EXHAUSTIVE = pytest.mark.slow
PAIRS = [
    pytest.param("2x2m2", "2x1m2", marks=EXHAUSTIVE),
    ("2x1m2", "2x1m2-interleaved"),
    pytest.param("2x1m2", "3x1m2", marks=EXHAUSTIVE),
    pytest.param("2x1m2", "2x2m2", marks=EXHAUSTIVE),
    pytest.param("2x1m2", "2x1m4", marks=EXHAUSTIVE),
    # a checkpoint of the rpc engine (the default before engine auto) resumed on the default:
    # on rpc, the engine its cut was made for
    pytest.param("2x1m2", "2x1m2-default", marks=EXHAUSTIVE),
]


@SHARES_RUNS
@pytest.mark.parametrize("first,then", PAIRS, ids=lambda s: s)
def test_a_pipeline_resumes_on_another_shape_as_a_run_of_that_shape(
    first: str, then: str, runs: Runs, tmp_path: Path
) -> None:
    (s1, m1, r1, e1), (s2, m2, r2, e2) = SHAPES[first], SHAPES[then]
    full_first = runs.full(first, pipeline(s1, m1, e1), r1)
    full_then = runs.full(then, pipeline(s2, m2, e2), r2)
    # The same maths at both shapes: their uninterrupted runs agree from the first step.
    assert_losses_close(full_first["summary"]["losses"], full_then["summary"]["losses"])

    root = stopped_at_k(full_first, tmp_path / "ckpt")
    resumed = run(pipeline(s2, m2, e2), tmp_path / "resumed", r2, root)
    summary = resumed["summary"]
    assert summary["resumedFromStep"] == K and summary["replicas"] == r2, resumed["output"]
    assert summary["engine"] == (e2 or {}).get("engine", "rpc"), summary
    if e2 == {}:  # the default chose pipelining afresh, and the checkpoint's engine on resume
        assert full_then["summary"]["engine"] == "pipelining", full_then["summary"]
        assert summary["engineChosen"] == "the checkpoint's cut was made for it", summary
    assert_losses_close(summary["losses"], full_then["summary"]["losses"][K:])

    # Each first stage read on from step K + 1's batch, its share of it, and one batch ahead:
    # what the uninterrupted run of this shape read from there, nothing else (after opening
    # the data, its sample 0, and for replica 0, maybe measuring the cut on the first batch).
    whole = BATCH * 2  # a step's batch, at every size (replicas.max 2)
    stream = StreamSampler(SIZE, whole, seed=3)
    names = ["stage0"] if r2 == 1 else [f"r{r}-stage0" for r in range(r2)]
    for r, name in enumerate(names):
        rows = share_of(whole, r, r2)
        shares = [
            i
            for step in range(K, STEPS + 1)
            for i in stream.take(step * whole + rows.start, len(rows))
        ]
        got = resumed["reads"][name]
        assert got[-len(shares) - 1 :] == [0, *shares], (name, got)
        assert got[: -len(shares) - 1] in ([], [0, *stream.take(0, BATCH)]), (name, got)


def test_the_pipelining_engine_takes_no_cut_the_rpc_engine_saved(tmp_path: Path) -> None:
    """The rpc engine may cut where the model passes ints, which the pipelining engine's
    stages cannot send: on it a checkpoint's cut is taken only where its own engine saved it
    (else the stages measure anew); the rpc engine takes either's, and engine auto (the
    default) takes either's and runs on the engine that saved it."""
    saved = {"kind": "PipelineJob", "ranges": [[0, 3], [3, 6]], "costs": [1.0] * 6}
    for engine, saved_by, taken in [
        ("pipelining", "rpc", False),
        ("pipelining", "pipelining", True),
        ("rpc", "pipelining", True),
        ("auto", "rpc", True),
        ("auto", "pipelining", True),
    ]:
        job = spec.parse(pipeline_job("cut", engine=engine, stages=2, microBatches=2))
        manifest = saved | {
            "engine": saved_by,
            "microBatches": 2,
            "model": models.as_spec(job.settings.model),
        }
        found = checkpoint.Checkpoint(4, tmp_path, manifest)
        ports = plan.Ports(*free_ports(2))
        env = world.read_env(plan.plan_world(job, lambda m: LOOPBACK, ports)[0].env)
        partition = saved_partition(env, found)
        assert (partition is not None) == taken, (engine, saved_by)
        if engine == "auto":
            assert partition is not None and partition.engine is not None
            assert partition.engine.engine == saved_by, partition.engine


# ------------------------------------------------------------------ HybridJob

BAGS = 48  # one bag per row of the table: an epoch is exactly STEPS steps of 12


def hybrid(root: Path, folder: Path, servers: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": "elastic-hybrid"},
        "spec": {
            "trainers": {"min": 2, "max": 3},
            "parameterServers": servers,
            "batchSize": BATCH,
            "steps": STEPS,
            "seed": 2,
            "logEvery": 1,
            "embedding": {"numEmbeddings": BAGS, "dim": 4},
            "dense": {
                "outFeatures": 4,
                "import": "userpkg.recorded:dense",
                "args": {"dim": 4, "classes": 4},
            },
            "data": {
                "import": "userpkg.recorded:bags",
                "args": {"folder": str(folder), "size": BAGS},
            },
            "optimizer": {"name": "sgd", "lr": 0.5},
            "sparseOptimizer": {"name": "adagrad", "lr": 0.5},
            "checkpoint": {"path": str(root), "everySteps": K},
            "rendezvousTimeoutSeconds": 60,
            "preflight": {"megabytes": 0.25},
        },
    }


# slow: two worlds: the pipeline's pair across engines and piece counts holds the resharding path
@SHARES_RUNS
@pytest.mark.slow
def test_a_hybrid_job_resumes_with_other_trainer_and_server_counts_as_a_run_of_those(
    runs: Runs, tmp_path: Path
) -> None:
    """2 trainers and 1 parameter server stopped at step K go on with 3 trainers and 2
    servers, which split the table row-wise (it is larger than a share): each server loads
    its rows and their Adagrad state from the one server's file that holds them."""
    two_servers = lambda root, folder: hybrid(root, folder, servers=2)  # noqa: E731
    two, three = runs.full("hybrid-2", hybrid, 2), runs.full("hybrid-3-ps2", two_servers, 3)
    assert_losses_close(two["summary"]["losses"], three["summary"]["losses"])

    root = stopped_at_k(two, tmp_path / "ckpt")
    resumed = run(two_servers, tmp_path / "resumed", 3, root)
    summary = resumed["summary"]
    assert summary["resumedFromStep"] == K and summary["trainers"] == 3, resumed["output"]
    assert summary["parameterServers"] == 2, summary
    assert all(s["steps"] == STEPS - K for s in summary["perServer"].values()), summary
    assert_losses_close(summary["losses"], three["summary"]["losses"][K:])
    assert "written by 2 trainer(s) and 1 parameter server(s)" in resumed["output"]

    # Each trainer read its sample 0 (how many dense features the data has), its share of
    # the first batch (to check the dense module), then its share of steps K + 1 on; with
    # what the stopped world's trainers had read, every bag of the epoch once.
    whole, epoch = BATCH * 3, order(BAGS, 2, 0)

    def shares(step: int, k: int, count: int) -> list[int]:
        return [epoch[step * whole + i] for i in share_of(whole, k, count)]

    trained = []
    for k in range(3):
        after = [i for step in range(K, STEPS) for i in shares(step, k, 3)]
        assert resumed["reads"][f"trainer{k}"] == [0, *shares(0, k, 3), *after], k
        trained += after
    before = [i for step in range(K) for k in range(2) for i in shares(step, k, 2)]
    assert sorted(before + trained) == list(range(BAGS))


@SHARES_RUNS
def test_a_checkpoint_of_another_model_is_refused_in_one_line(runs: Runs, tmp_path: Path) -> None:
    """What no shape can resume: the job fails at once, permanently, saying why (no
    traceback, no restart spent)."""
    full = runs.full("2x1m2", pipeline(2, 2), 1)
    root = stopped_at_k(full, tmp_path / "ckpt")

    def wider(root: Path, folder: Path) -> dict[str, Any]:
        manifest = pipeline(2, 2)(root, folder)
        manifest["spec"]["model"]["args"]["width"] = 8
        return manifest

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "reads").mkdir()
    with JobRun(wider(root, tmp_path / "other" / "reads"), tmp_path / "other") as job:
        assert job.finish(200) == ExitCode.PERMANENT, job.output
    assert re.search(
        r"^master\s*\| permanent: CheckpointUnusable: .*step-00000002 holds a"
        r" checkpoint of model \{.*'args': \{'classes': 10\}\}, not model \{.*"
        r"'width': 8\}\}; give this job another checkpoint.path",
        job.output,
        re.M,
    ), job.output
    assert "Traceback" not in job.output
