"""Same seed, same bits (issue 57): two runs of one manifest write byte-identical output files
and log identical losses, on both engines. On the rpc engine, distributed autograd runs the
micro-batches' backwards through a stage as their gradients arrive, and would add them into each
parameter in that order; the stages add them themselves, in micro-batch order
(pipeline/rpc/gradient_sum.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from userdata import BYTE_VOCAB, write_stdlib_tokens

from jobrun import pipeline_job, run_to_end
from pipejob.core import spec
from pipejob.trainer.pipeline.rpc.gradient_sum import RoundGradients, walk_backward
from pipejob.trainer.runtime import determinism

TRANSFORMER = {"vocabSize": BYTE_VOCAB, "layers": 2, "width": 32, "heads": 2, "seqLen": 32}


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stdlib-bytes")
    train = root / "train.bin"
    write_stdlib_tokens(train, max_bytes=100_000)
    return {"train": str(train)}


def lm_job(text: dict[str, str], **fields: Any) -> dict[str, Any]:
    """A small language model in 2 stages, 4 micro-batches, clipped: every sum a step makes;
    on the rpc engine unless `fields` say otherwise."""
    return pipeline_job(
        "same-bits",
        **{
            "engine": "rpc",
            "model": {"transformer": TRANSFORMER},
            "data": {"tokens": text, "workers": 1},
            "stages": 2,
            "batchSize": 16,
            "microBatches": 4,
            "steps": 4,
            "seed": 7,
            "optimizer": {"name": "adamw", "lr": 0.003, "clipGradNorm": 0.5},
            # The cut pinned: one measured on a busy machine may fall elsewhere in another
            # run, and the global norm sums stage by stage (the guide says so).
            "splitPoints": ["blocks.1"],
            **fields,
        },
    )


def test_deterministic_asks_torch_for_deterministic_kernels():
    assert spec.parse(pipeline_job("j")).spec["deterministic"] is False  # the default
    environ: dict[str, str] = {}
    assert not determinism.apply(False, environ) and environ == {}
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        assert determinism.apply(True, environ)
        assert torch.are_deterministic_algorithms_enabled()
        assert environ == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        mine = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
        determinism.apply(True, mine)
        assert mine == {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}  # a user's setting wins
    finally:
        torch.use_deterministic_algorithms(False)


def test_deterministic_is_a_boolean():
    with pytest.raises(ValueError, match="spec.deterministic: must be true or false"):
        spec.parse(pipeline_job("j", deterministic="yes"))


# Three float32 gradients whose sum depends on the order they are added in.
PIECES = [torch.tensor([1.0]), torch.tensor([1e8]), torch.tensor([-1e8])]


@pytest.mark.parametrize("arrival", [[0, 1, 2], [2, 1, 0], [1, 2, 0], [2, 0, 1]])
def test_a_rounds_gradients_add_in_micro_batch_order_whatever_their_arrival(arrival):
    sums = RoundGradients(step=0, round=0, in_order=True, buffers={})
    for mb in arrival:
        sums.add(mb, "w", PIECES[mb])
    for mb in arrival:
        sums.done(mb)
    assert sums.total["w"].item() == ((PIECES[0] + PIECES[1]) + PIECES[2]).item() == 0.0
    assert PIECES[0].item() == 1.0  # autograd's tensors are never changed in place


def test_a_rounds_sum_is_made_in_the_stages_buffers_step_after_step():
    buffers: dict[str, torch.Tensor] = {}
    made, values = [], []
    for step, pieces in enumerate([PIECES, [p * 2 for p in PIECES], PIECES[:1]]):
        sums = RoundGradients(step=step, round=0, in_order=True, buffers=buffers)
        for mb, piece in enumerate(pieces):
            sums.add(mb, "w", piece)
            sums.done(mb)
        total = sums.merged({})["w"]
        made.append(total)
        values.append(total.item())
    assert values == [0.0, 0.0, 1.0]  # in micro-batch order; a lone gradient copied in
    assert made[0] is made[1] is made[2] is buffers["w"]  # one tensor, reused
    assert PIECES[0].item() == 1.0  # autograd's tensors are never changed in place


def test_a_stage_takes_its_parameters_gradients_from_the_nodes_that_hand_them_on():
    """Every gradient a parameter gets, from each node that uses it, goes to the stage (none
    to autograd), and the walk ends at the nodes nearest the inputs."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    shared = layers[0].weight  # used twice: in the layer and again below
    x = torch.randn(3, 4, requires_grad=True)
    h = x * 1.0
    stop = h.grad_fn  # as the node that sends a stage's input gradient to the stage before
    y = layers(h) + (h @ shared.T).sum(1, keepdim=True)
    expected = torch.autograd.grad(y.sum(), [*layers.parameters(), x], retain_graph=True)

    names = {id(p): n for n, p in layers.named_parameters()}
    taken: dict[str, torch.Tensor] = {}

    def take(name: str, grad: torch.Tensor) -> None:
        taken[name] = taken[name] + grad if name in taken else grad

    ends = walk_backward([y.grad_fn], {stop}, names, take)
    y.sum().backward()
    for (name, p), grad in zip(layers.named_parameters(), expected, strict=False):
        assert p.grad is None, name  # none reached autograd's accumulator
        torch.testing.assert_close(taken[name], grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, expected[-1])  # the input's gradient still flows
    assert ends and all(
        all(f in (None, stop) or type(f).__name__ == "AccumulateGrad" for f, _ in e.next_functions)
        for e in ends
    )


def run(job: dict[str, Any], directory: Path, timeout: float) -> tuple[list[float], dict]:
    """One run of `job` writing its output in `directory`: its losses, and its output files'
    bytes by name."""
    directory.mkdir()
    job = {**job, "spec": {**job["spec"], "output": {"path": str(directory / "out")}}}
    code, out, summary = run_to_end(job, directory, timeout)
    assert code == 0, out
    assert summary is not None, out
    files = {
        str(p.relative_to(directory / "out")): p.read_bytes()
        for p in sorted((directory / "out").rglob("*"))
        if p.is_file()
    }
    assert files, out
    return summary["losses"], files


def assert_same_bits(job: dict[str, Any], tmp_path: Path, timeout: float = 150) -> None:
    """Two runs of `job`: the same losses to the last bit, the same output bytes."""
    losses_a, files_a = run(job, tmp_path / "a", timeout)
    losses_b, files_b = run(job, tmp_path / "b", timeout)
    assert losses_a == losses_b
    assert files_a.keys() == files_b.keys()
    differ = [name for name in files_a if files_a[name] != files_b[name]]
    assert not differ, f"{differ} differ between two runs of one manifest"


@pytest.mark.timeout(360)
def test_the_rpc_engine_repeats_itself_with_four_micro_batches(text, tmp_path: Path):
    assert_same_bits(lm_job(text), tmp_path)


@pytest.mark.timeout(360)
def test_the_pipelining_engine_repeats_itself(text, tmp_path: Path):
    assert_same_bits(lm_job(text, engine="pipelining", schedule="1f1b"), tmp_path)


# slow: a world of 5 twice; the one-replica case above holds the stages' order
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_replicas_repeat_themselves(text, tmp_path: Path):
    assert_same_bits(lm_job(text, replicas=2), tmp_path, timeout=300)


# slow: the same stage code as 4 micro-batches; a middle stage and gradientAccumulation
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_three_stages_with_accumulation_repeat_themselves(text, tmp_path: Path):
    job = lm_job(text, stages=3, gradientAccumulation=2, steps=3)
    job["spec"]["splitPoints"] = ["blocks.0.mlp.0", "blocks.1"]
    assert_same_bits(job, tmp_path, timeout=300)


# slow: the pipelining engine's schedules run each micro-batch's backward in turn
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved-1f1b"])
def test_the_pipelining_schedules_repeat_themselves(text, tmp_path: Path, schedule: str):
    fields: dict[str, Any] = {"engine": "pipelining", "schedule": schedule}
    if schedule == "interleaved-1f1b":
        fields["stagesPerProcess"] = 2
        fields["splitPoints"] = ["blocks.0.mlp.0", "blocks.1.proj", "blocks.1.mlp.0"]
    assert_same_bits(lm_job(text, **fields), tmp_path, timeout=300)


@pytest.mark.timeout(360)
def test_a_stages_dropout_draws_the_same_masks_in_every_run(tmp_path: Path, monkeypatch):
    """Each stage process's own random stream, which dropout draws from, starts from
    spec.seed: torch seeds a new process's generator at random."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # userpkg, for every process
    job = pipeline_job(
        "same-masks",
        engine="rpc",
        model={"import": "userpkg.vision:small_cnn", "args": {"classes": 10, "dropout": 0.5}},
        imageSize=32,
        numClasses=10,
        stages=2,
        batchSize=16,
        microBatches=2,
        steps=3,
        seed=5,
        splitPoints=["7"],  # the second stage holds the Dropout
        optimizer={"name": "sgd", "lr": 0.05},
    )
    assert_same_bits(job, tmp_path)


HYBRID = {
    "apiVersion": "pipejob.dev/v1alpha1",
    "kind": "HybridJob",
    "metadata": {"name": "same-bits-hybrid"},
    "spec": {
        "trainers": 2,
        "parameterServers": 2,
        "embeddings": [
            {"name": "a", "rows": 64, "dim": 8},
            {"name": "b", "rows": 48, "dim": 8},
        ],
        "dense": {"outFeatures": 4},
        "steps": 6,
        "batchSize": 8,
        "bagSize": 4,
        "datasetSize": 64,
        "seed": 3,
        "optimizer": {"name": "sgd", "lr": 0.2, "momentum": 0.9},
        "sparseOptimizer": {"name": "adagrad", "lr": 0.2},
        "rendezvousTimeoutSeconds": 60,
        "preflight": {"megabytes": 0.5},
    },
}


# slow: a world of 6 twice; the servers apply the trainers' updates in their order (ps.py)
# and DDP's all-reduce is gloo's fixed ring: the rpc case above holds the stages' sums
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_hybrid_job_with_two_trainers_and_two_servers_repeats_itself(tmp_path: Path):
    assert_same_bits(HYBRID, tmp_path, timeout=300)


def resumed(job: dict[str, Any], directory: Path, at: int, timeout: float) -> tuple[list, dict]:
    """`job` run to step `at` with a checkpoint, then again to its end: it resumes there. The
    second run's losses and output files."""
    directory.mkdir()
    spec = {**job["spec"], "checkpoint": {"path": str(directory / "ckpt"), "everySteps": at}}
    first = {**job, "spec": {**spec, "steps": at}}
    run(first, directory / "first", timeout)
    losses, files = run({**job, "spec": spec}, directory / "then", timeout)
    assert len(losses) == job["spec"]["steps"] - at  # it did resume
    return losses, files


def without_first_loss(text: bytes) -> bytes:
    """A model file's description without `metrics.firstLoss` (a resumed run's first step
    is a later one)."""
    described = json.loads(text)
    described.get("metrics", {}).pop("firstLoss", None)
    return json.dumps(described).encode()


# slow: three runs of a world of 6 or 3; the float64 tests of test_hybrid.py run the servers
# in the trainers' processes against one process
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_servers_in_the_trainers_processes_give_the_same_bits_resumed_too(tmp_path: Path):
    """spec.serversInTrainers changes where the servers run, not what they compute: the
    same losses and output bytes as servers of their own, also through a checkpoint the
    trainers' servers wrote (ps<i>.pt, saved over RPC to themselves) and loaded."""
    losses, files = run(HYBRID, tmp_path / "own", 150)
    inside = {**HYBRID, "spec": {**HYBRID["spec"], "serversInTrainers": True}}
    at = HYBRID["spec"]["steps"] // 2
    resumed_losses, resumed_files = resumed(inside, tmp_path / "inside", at, 150)
    assert resumed_losses == losses[at:]
    for found in (files, resumed_files):  # the run's own first loss, not the model's
        found["model.json"] = without_first_loss(found["model.json"])
    assert resumed_files == files


# slow: two runs each (a world of 3, 4 or 6); what the resume keeps is held in float64 by
# test_checkpoint.py, the bits of a step by the two-runs tests above
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["rpc", "pipelining", "hybrid"])
def test_a_resumed_run_is_bit_identical_to_an_uninterrupted_one(text, tmp_path: Path, engine: str):
    job = HYBRID if engine == "hybrid" else lm_job(text, engine=engine)
    losses, files = run(job, tmp_path / "straight", 250)
    at = job["spec"]["steps"] // 2
    resumed_losses, resumed_files = resumed(job, tmp_path / "resumed", at, 250)
    assert resumed_losses == losses[at:]
    assert resumed_files.keys() == files.keys()
    for found in (files, resumed_files):  # the run's own first loss, not the model's
        found["model.json"] = without_first_loss(found["model.json"])
    differ = [name for name in files if files[name] != resumed_files[name]]
    assert not differ, f"{differ} differ between a resumed run and an uninterrupted one"


def test_a_safetensors_file_is_the_same_bytes_every_time(tmp_path: Path):
    """safetensors orders its header's metadata by a hash map's seed: pipejob sorts it."""
    from safetensors.torch import load_file

    from pipejob.trainer.runtime import model_files

    state = {"b": torch.ones(3), "a": torch.zeros(2, 2)}
    meta = {"": {"version": 1}, "a": {"version": 2}}
    written = set()
    for k in range(8):
        path = tmp_path / f"m{k}.safetensors"
        model_files.save(path, state, "safetensors", meta)
        written.add(path.read_bytes())
        assert load_file(str(path)).keys() == state.keys()
    assert len(written) == 1
