"""A model over the single-file limit written without one process holding it: each stage of a
real pipeline world writes its own shard, the master the state no stage holds and the index
(Hugging Face's layout), and the folder loads back strictly into a fresh model equal to the
trained one (and with `from_pretrained`, for a Hugging Face model). `pipejob export` writes
the same files from the run's checkpoint, one stage's file at a time. The limit is the
master's module constant, set to 0 in the spawned master so that a tiny model goes sharded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from userpkg import brought, tied

from harness.variants import exhaustive
from jobrun import pipeline_job, run_world
from pipejob.core import plan, spec
from pipejob.runner.local import LOOPBACK, free_ports
from pipejob.trainer import pipeline
from pipejob.trainer.pipeline import trained_model
from pipejob.trainer.pipeline.run_json import PipelineModelInfo
from pipejob.trainer.runtime import checkpoint, model_files, world

pytestmark = pytest.mark.timeout(300)

TOKENS = {"import": "userpkg.brought:windows"}


def _member(rank: int, envs: list[dict[str, str]], out: str) -> None:
    """One process of a real pipeline world running the trainer's own roles; the master's
    single-file limit is 0, so the model goes out as shards."""
    os.environ.update(envs[rank])
    env = world.read_env()
    if env.role != "master":
        pipeline.run(env)
        return
    trained_model.SINGLE_FILE_BYTES = 0
    torch.save(pipeline.run(env), out)


def files_of(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def shard_states(folder: Path, names: list[str], format: str) -> list[dict[str, torch.Tensor]]:
    """Each shard file's own tensors, as a plain process reads it."""
    if format == "safetensors":
        return [load_file(folder / name) for name in names]
    return [torch.load(folder / name, weights_only=True) for name in names]


def assert_same_states(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


# name: (factory, its args, output format, is it a Hugging Face model)
MODELS: dict[str, tuple[Any, dict[str, Any], str, bool]] = {
    # tied across stages under two names; config.json, so from_pretrained
    "gpt2": (brought.gpt2, {}, "safetensors", True),
    # tied across stages under one name (both shards hold embed.weight); an unused layer
    "tied": (tied.tied_lm, {}, "torch", False),
    # the same on the pipelining engine, each stage process holding two pieces (the first
    # and third, the second and fourth) whose state it writes as one shard
    "tied-interleaved": (tied.tied_lm, {}, "torch", False),
}
ENGINES = {
    "tied-interleaved": {
        "engine": "pipelining",
        "schedule": "interleaved-1f1b",
        "stagesPerProcess": 2,
    }
}


@pytest.mark.parametrize("name", exhaustive(MODELS, {"tied-interleaved"}))  # gpt2, tied: slow
def test_a_model_over_the_limit_goes_out_as_shards_and_loads_back(name: str, tmp_path: Path):
    factory, args, format, hugging_face = MODELS[name]
    out, ckpt, steps = tmp_path / "model", tmp_path / "checkpoints", 2
    importable = f"userpkg.{factory.__module__.rsplit('.', 1)[-1]}:{factory.__name__}"
    job = spec.parse(
        pipeline_job(
            f"sharded-{name}",
            model={"import": importable, "args": args},
            data=TOKENS,
            stages=2,
            steps=steps,
            microBatches=2,
            output={"path": str(out), "format": format},
            checkpoint={"path": str(ckpt), "everySteps": steps},
            **ENGINES.get(name, {}),
        )
    )
    # A stale single file of an earlier run into the same folder, which from_pretrained
    # would prefer to the index: the sharded output removes it.
    out.mkdir()
    (out / f"model{model_files.SUFFIX[format]}").write_bytes(b"stale")
    rpc_port, ddp_port = free_ports(2)
    processes = plan.plan_world(job, lambda m: LOOPBACK, plan.Ports(rpc_port, ddp_port))
    summary = run_world(_member, [p.env for p in processes], tmp_path / "summary.pt", 240)
    assert summary["steps"] == steps

    # What the stages held at the end, as the checkpoint of the last step keeps it.
    found = checkpoint.latest(ckpt)
    assert found is not None and found.step == steps
    stages = [found.load(f"stage{i}.pt")["model"] for i in range(2)]
    rest = found.load("master.pt")["rest"]
    assert bool(rest) == name.startswith("tied")  # the unused layer
    files = trained_model.shard_files(2, bool(rest), format)
    assert files[0] == f"model-00001-of-0000{len(files)}{model_files.SUFFIX[format]}"
    index_name = model_files.index_name(format)
    extra = ["config.json"] if hugging_face else []
    assert files_of(out) == sorted([*files, index_name, "model.json", *extra])
    info = json.loads((out / "model.json").read_text())
    assert info["format"] == format and info["steps"] == steps
    assert set(info) - {"format", "files"} == PipelineModelInfo.__required_keys__  # run_json's
    assert sorted(info["files"].values()) == sorted([*files, index_name])

    # Each stage wrote exactly its state; the master the rest.
    shards = shard_states(out, files, format)
    for i, state in enumerate(stages):
        assert_same_states(shards[i], state)
    if rest:
        assert_same_states(shards[-1], rest)

    # The index maps every name of the model's state dict to one shard, exactly once.
    fresh = factory(**args)
    index = json.loads((out / index_name).read_text())
    assert sorted(index["weight_map"]) == sorted(fresh.state_dict())
    for key, file in index["weight_map"].items():
        assert key in shards[files.index(file)], (key, file)
    expected_size = sum(t.numel() * t.element_size() for t in fresh.state_dict().values())
    assert index["metadata"]["total_size"] == expected_size
    if name.startswith("tied"):  # held by both stages: the first stage's shard
        assert index["weight_map"]["embed.weight"] == files[0] and "embed.weight" in shards[1]
        assert index["weight_map"]["spare.weight"] == files[-1]

    # The folder loads strictly into a fresh model from the factory: the trained model.
    trained: dict[str, torch.Tensor] = dict(rest)
    for state in stages:
        trained |= state
    loaded = model_files.load_state_dict(out)
    assert loaded._metadata == dict(fresh.state_dict()._metadata)  # the modules' versions
    fresh.load_state_dict(loaded, strict=True)
    assert_same_states(dict(fresh.state_dict()), trained)
    if hugging_face:
        again = type(fresh).from_pretrained(out)
        for key, value in trained.items():
            assert torch.equal(again.state_dict()[key], value), key

    # `pipejob export` from the checkpoint: the same files, the same tensors.
    exported = tmp_path / "exported"
    trained_model.export_checkpoint(
        found.directory, found.manifest, exported, format, single_file_bytes=0
    )
    assert files_of(exported) == files_of(out)
    assert json.loads((exported / index_name).read_text()) == index
    for got, wrote in zip(shard_states(exported, files, format), shards, strict=True):
        assert_same_states(got, wrote)
    # Under the limit (the default's, for this tiny model): one file, the same model.
    single = tmp_path / "single"
    trained_model.export_checkpoint(found.directory, found.manifest, single, "safetensors")
    assert files_of(single) == sorted(["model.safetensors", "model.json", *extra])
    assert_same_states(model_files.load_state_dict(single), trained)


class Shared(nn.Module):
    """Two names of one tensor (a tie inside one stage), a view of a bigger storage, and a
    non-contiguous buffer: what safetensors refuses as they are."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        whole = torch.arange(24.0)
        self.register_buffer("view", whole[4:12])
        self.register_buffer("transposed", whole.reshape(4, 6).t())


@pytest.mark.parametrize("format", list(model_files.SUFFIX))
def test_shards_with_ties_and_views_load_back_by_the_index(format: str, tmp_path: Path):
    model = Shared()
    state = model.state_dict()
    first = {k: v for k, v in state.items() if k.startswith("a.")}
    second = {k: v for k, v in state.items() if not k.startswith("a.")} | {
        "a.bias": state["a.bias"]
    }
    names = trained_model.shard_files(2, False, format)
    parts = [
        model_files.write_shard(tmp_path, f, s, format)
        for f, s in zip(names, (first, second), strict=True)
    ]
    assert [p["file"] for p in parts] == names
    assert all(p["bytes"] == (tmp_path / p["file"]).stat().st_size for p in parts)
    model_files.write_index(tmp_path, parts, {"job": "t"}, format)
    index = json.loads((tmp_path / model_files.index_name(format)).read_text())
    assert index["weight_map"]["a.bias"] == names[0]  # held by both: the first shard's
    assert sorted(index["weight_map"]) == sorted(state)
    fresh = Shared()
    fresh.load_state_dict(model_files.load_state_dict(tmp_path), strict=True)
    assert_same_states(dict(fresh.state_dict()), dict(state))
    # Written as they were: the model's own tensors are not copied where they need not be.
    assert model_files.writable(first)["a.weight"].data_ptr() == model.a.weight.data_ptr()


def test_a_missing_model_and_a_shard_short_of_its_index_are_named(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="holds no model.safetensors, model.pt or index"):
        model_files.load_state_dict(tmp_path)
    part = model_files.write_shard(
        tmp_path, "model-00001-of-00001.safetensors", {"w": torch.ones(2)}, "safetensors"
    )
    part["sizes"]["v"] = 8  # an index that says the shard holds more than it does
    model_files.write_index(tmp_path, [part], {}, "safetensors")
    with pytest.raises(ValueError, match="model-00001-of-00001.safetensors lacks v, which"):
        model_files.load_state_dict(tmp_path)


def test_a_shard_the_master_does_not_see_fails_naming_the_shared_path(tmp_path: Path):
    """A stage whose output.path is not the master's (no shared volume) wrote its shard where
    the master cannot see it: a configuration error (ValueError: permanent, no restarts)."""
    wrote = model_files.write_shard(
        tmp_path / "stage", "model-00001-of-00001.safetensors", {"w": torch.ones(2)}, "safetensors"
    )
    with pytest.raises(
        ValueError,
        match=r"model-00001-of-00001.safetensors is missing where its"
        r" writer wrote \d+ bytes; .* shared by every process",
    ):
        trained_model.finish(tmp_path / "master", "safetensors", [wrote], {}, None)
