"""Jobs on GPUs, end to end through `pipejob run`: PipelineJobs of 2 and 4 stages, the
transformer, replicas, a HybridJob, a checkpoint and its resume, evaluation and the model
file. Marked `gpu`: without CUDA they skip (tests/conftest.py, one line in the summary).

Written for any GPU count, one included: the runner gives each process its own GPU where
there are enough and lets pipeline stages share one where there are not (saying so), and
refuses, before starting anything, a job whose NCCL group members would share a GPU
(runner/gpus.py); a test whose job needs more GPUs than this machine has checks that
refusal instead. A run that passes computed on a GPU: the master gives the stages
`cuda:0` whenever `gpusPerStage` is set, and a HybridJob trainer fails without CUDA.
Small models and few steps: each test is bounded by its timeout."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from userdata import BYTE_VOCAB, write_stdlib_tokens

from jobrun import pipeline_job, run_to_end
from pipejob.core import spec
from pipejob.trainer.workloads import data, models

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

TIMEOUT = 280


def gpus() -> int:
    return torch.cuda.device_count()


def gpu_job(name: str, **fields: Any) -> dict[str, Any]:
    return pipeline_job(name, gpusPerStage=1, **fields)


def shares(output: str) -> bool:
    """Whether the runner said the processes share GPUs."""
    return (
        re.search(
            r"^pipejob: the job asks for \d+ GPUs and this machine has \d+ GPUs?:"
            r" its processes share them",
            output,
            re.M,
        )
        is not None
    )


def trained(code: int, output: str, summary: dict[str, Any] | None, steps: int) -> dict:
    assert code == 0, output
    assert summary is not None, output
    assert len(summary["losses"]) == steps and all(map(math.isfinite, summary["losses"]))
    assert summary["samplesPerSecond"] > 0
    return summary


def refused(code: int, output: str) -> None:
    """The runner refused the job before starting anything, saying why with the numbers."""
    assert code == 2, output
    assert "started" not in output, output
    assert re.search(
        r"^pipejob: cannot run \w+ '\S+' here: .* would share a GPU: the job asks"
        rf" for \d+ GPUs and this machine has {gpus()} GPUs?",
        output,
        re.M,
    ), output


@pytest.mark.parametrize("stages", [2, 4])
def test_a_resnet_pipeline_trains_on_gpus(tmp_path: Path, stages: int):
    job = gpu_job(f"gpu-{stages}", stages=stages, microBatches=4, batchSize=16, steps=4)
    code, output, summary = run_to_end(job, tmp_path, timeout=TIMEOUT)
    s = trained(code, output, summary, 4)
    assert shares(output) == (gpus() < stages), output
    assert [st["stage"] for st in s["partition"]] == [f"stage{i}" for i in range(stages)]
    for st in s["partition"]:
        assert st["forwardSeconds"] > 0 and st["backwardSeconds"] > 0, st


def test_the_transformer_learns_on_gpus(tmp_path: Path):
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    write_stdlib_tokens(train, max_bytes=400_000)
    write_stdlib_tokens(val, max_bytes=60_000, split="val")
    job = gpu_job(
        "gpu-lm",
        stages=2,
        steps=60,
        logEvery=20,
        batchSize=16,
        microBatches=4,
        model={
            "transformer": {
                "vocabSize": BYTE_VOCAB,
                "layers": 3,
                "width": 64,
                "heads": 4,
                "seqLen": 64,
            }
        },
        data={"tokens": {"train": str(train), "val": str(val)}, "workers": 1},
        optimizer={"name": "adam", "lr": 0.003},
        eval={"everySteps": 60, "batches": 4},
    )
    code, output, summary = run_to_end(job, tmp_path, timeout=TIMEOUT)
    s = trained(code, output, summary, 60)
    losses = s["losses"]
    # As on CPU (tests/test_language_model.py): from ln 256 = 5.5 towards byte-level text.
    assert sum(losses[-10:]) / 10 < losses[0] - 1.5, losses
    assert 1 < s["evaluation"]["perplexity"] < 40, s["evaluation"]


def test_gpu_stages_train_exactly_what_cpu_stages_train(tmp_path: Path, monkeypatch):
    """The same float64 job (tests/userpkg/exact.py) on GPU stages (sharing one on a one-GPU
    machine) and on CPU stages: 4 steps of SGD with momentum give the same losses up to
    float64 rounding. Work the RPC agent runs on different CUDA streams that raced (a forward
    reading parameters the last step's optimizer is still writing, micro-batches' gradients
    accumulating on two streams) would be far above it: a step moves the weights by about
    1e-3 of their scale; other kernels' rounding, after BatchNorm's backward amplifies it, by
    about 1e-12."""
    paths = [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))  # userpkg for the processes
    fields = {
        "model": {"import": "userpkg.exact:resnet18", "args": {"classes": 10}},
        "data": {"import": "userpkg.exact:images", "args": {"image_size": 32}},
        "stages": 2,
        "microBatches": 4,
        "batchSize": 16,
        "steps": 4,
        "splitPoints": ["layer3.0"],
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    }
    runs = {}
    for where, job in (("gpu", gpu_job), ("cpu", pipeline_job)):
        (tmp_path / where).mkdir()
        out = tmp_path / where / "model"
        manifest = job(f"exact-{where}", output={"path": str(out)}, **fields)
        code, output, summary = run_to_end(manifest, tmp_path / where, timeout=TIMEOUT)
        runs[where] = trained(code, output, summary, 4), load_file(out / "model.safetensors")
    (gpu, on_gpu), (cpu, on_cpu) = runs["gpu"], runs["cpu"]
    assert gpu["losses"] == pytest.approx(cpu["losses"], abs=2e-6)  # the summary's 6 decimals
    assert on_gpu.keys() == on_cpu.keys()
    for name, value in on_cpu.items():
        assert on_gpu[name].dtype == value.dtype, name
        if not value.is_floating_point():  # BatchNorm's num_batches_tracked
            assert torch.equal(on_gpu[name], value), name
            continue
        assert value.dtype == torch.float64, name
        off = (on_gpu[name] - value).abs().max().item()
        assert off <= 1e-7 * max(value.abs().max().item(), 1e-3), f"{name}: off by {off:.3g}"


def test_replicas_train_on_gpus_or_are_refused(tmp_path: Path):
    # Stage i of each replica averages its gradients over NCCL: 2 GPUs keep those apart.
    job = gpu_job("gpu-replicas", stages=2, replicas=2, microBatches=2, steps=3)
    code, output, summary = run_to_end(job, tmp_path, timeout=TIMEOUT)
    if gpus() < 2:
        refused(code, output)
        return
    s = trained(code, output, summary, 3)
    assert s["replicas"] == 2
    # Replicas start equal and step on the same averaged gradients (an all-reduce leaves
    # every rank the same sum), as on CPU (tests/test_replicas.py).
    assert s["replicaDivergence"] == 0.0, s


HYBRID = {
    "apiVersion": "pipejob.dev/v1alpha1",
    "kind": "HybridJob",
    "metadata": {"name": "gpu-hybrid"},
    "spec": {
        "trainers": 2,
        "gpusPerTrainer": 1,
        "embedding": {"numEmbeddings": 64, "dim": 8, "mode": "sum"},
        "dense": {"outFeatures": 4},
        "steps": 40,
        "batchSize": 8,
        "bagSize": 4,
        "datasetSize": 101,
        "seed": 3,
        "optimizer": {"name": "sgd", "lr": 0.2, "momentum": 0.5},
        "logEvery": 10,
        "eval": {"everySteps": 20},
        "rendezvousTimeoutSeconds": 60,
    },
}


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_hybrid_job_trains_on_gpus_and_writes_its_model(tmp_path: Path, backend: str):
    out = tmp_path / "model"
    job = HYBRID | {"spec": HYBRID["spec"] | {"backend": backend, "output": {"path": str(out)}}}
    code, output, summary = run_to_end(job, tmp_path, timeout=TIMEOUT)
    if backend == "nccl" and gpus() < 2:
        refused(code, output)  # NCCL would stop it mid-run: "Duplicate GPU detected"
        return
    assert code == 0, output
    assert summary is not None, output
    assert summary["denseMaxAbsDiff"] == 0.0  # DDP kept the trainers' dense layers equal
    assert summary["embeddingChangeNorm"] > 0
    assert summary["finalLoss"] < 0.7 * summary["firstLoss"], summary
    assert summary["evalStep"] == 40 and 0 <= summary["evalAccuracy"] <= 1
    info = json.loads((out / "model.json").read_text())
    assert info["files"] == {"table": "table.safetensors", "dense": "dense.safetensors"}
    assert info["metrics"]["evalAccuracy"] == summary["evalAccuracy"]
    dense = load_file(out / "dense.safetensors")  # written from the GPU, read on CPU
    assert dense and all(torch.isfinite(t).all() for t in dense.values())


def test_a_checkpoint_written_on_gpus_resumes_there(tmp_path: Path, monkeypatch):
    """4 steps with a checkpoint every 2, then the same job for 6: the second run resumes
    from step 4 (pieces and optimizer state loaded back onto the GPUs) and trains 5 and 6,
    as a run of 6 straight does. In float64 (tests/userpkg/exact.py): in float32 the GPU's
    kernels (atomics in cuDNN's backward) leave each run a little apart, and SGD with
    momentum at this learning rate makes 6 steps of that a difference of 15-40% (seen on an
    H200), which would hide a resume that is wrong."""
    paths = [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))  # userpkg for the processes
    ckpt = {"path": str(tmp_path / "ckpt"), "everySteps": 2}
    common = {
        "stages": 2,
        "microBatches": 2,
        "batchSize": 16,
        "splitPoints": ["layer3.0"],
        "model": {"import": "userpkg.exact:resnet18", "args": {"classes": 10}},
        "data": {"import": "userpkg.exact:images", "args": {"image_size": 32}},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    }
    first = gpu_job("gpu-resume", steps=4, checkpoint=ckpt, **common)
    trained(*run_to_end(first, tmp_path, timeout=TIMEOUT), 4)
    again = gpu_job("gpu-resume", steps=6, checkpoint=ckpt, **common)
    code, output, summary = run_to_end(again, tmp_path, timeout=TIMEOUT)
    s = trained(code, output, summary, 2)
    assert re.search(r"^master\s*\| resumed from step 4 \(", output, re.M), output
    assert s["resumedFromStep"] == 4
    straight = gpu_job("gpu-straight", steps=6, **common)
    whole = trained(*run_to_end(straight, tmp_path, timeout=TIMEOUT), 6)
    assert s["losses"] == pytest.approx(whole["losses"][4:], abs=2e-6)  # 6 decimals


def test_evaluation_and_the_model_file_on_gpus_match_a_plain_cpu_model(tmp_path: Path):
    out = tmp_path / "model"
    job = gpu_job(
        "gpu-eval",
        stages=2,
        microBatches=2,
        steps=6,
        eval={"everySteps": 3, "batches": 4},
        output={"path": str(out)},
    )
    code, output, summary = run_to_end(job, tmp_path, timeout=TIMEOUT)
    s = trained(code, output, summary, 6)
    evaluation = s["evaluation"]
    assert [e["step"] for e in s["evaluations"]] == [3, 6]
    # The file written from the GPUs loads strictly into the model built on CPU, and gives
    # the held-out accuracy the run reported: the same batches, within the few samples whose
    # top two logits are close enough for GPU and CPU kernels to order them differently.
    parsed = spec.parse(job).settings
    model = models.build(parsed)
    model.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    model.eval()
    held = data.held_out(parsed)
    assert held is not None
    correct = samples = 0
    with torch.no_grad():
        for inputs, labels in held.batches(4):
            correct += int((model(inputs).argmax(1) == labels).sum())
            samples += len(labels)
    assert samples == evaluation["samples"]
    assert correct / samples == pytest.approx(evaluation["accuracy"], abs=2 / samples)
