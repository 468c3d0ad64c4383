"""Models users bring, as they bring them: Hugging Face transformers (GPT-2 with its tied
embeddings, Llama, a BERT classifier; raw, returning a ModelOutput, or under a user's
wrapper), timm (a CNN, a ConvNeXt, a ViT) and a model returning a dict, each cut into 2 or 3
stages where the cut sees fit (inside the wrapper, between transformer blocks) or at a
`splitPoints` name deep in the tree. Step 1's loss and every gradient equal one process's
(in float64, as jobrun.check_gradients), the tied pair's included: through a real pipeline
world for what crosses the RPC boundary (ModelOutputs, dicts, a tied pair across stages),
in this process for the rest. The model the stages hold, written as spec.output writes it,
loads strictly into a fresh model from the user's factory (and with `from_pretrained` for
the Hugging Face ones). And the held-out figures follow the shapes of what the model
returns."""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from userpkg import brought

from harness.variants import exhaustive
from jobrun import (
    EXACT,
    TOLERANCE,
    assert_gradient_close,
    check_gradients,
    pipeline_job,
    run_to_end,
)
from pipejob.core import spec
from pipejob.trainer.pipeline import trained_model
from pipejob.trainer.runtime import checkpoint
from pipejob.trainer.runtime.model_files import load_state_dict
from pipejob.trainer.workloads.cut import Traced, join, unused, without_cache
from pipejob.trainer.workloads.metrics import cross_entropy

pytestmark = pytest.mark.timeout(300)

TOKENS = {"import": "userpkg.brought:windows"}
CLASSES = {"import": "userpkg.brought:windows", "args": {"classes": 3}}
VIT = {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2}

# name: (factory in userpkg/brought.py, its args, data, stages, split points). Through a real
# pipeline world: what crosses the RPC boundary (ModelOutputs, dicts, a tied pair).
WORLDS: dict[str, tuple[str, dict[str, Any], dict[str, Any], int, list[str]]] = {
    "gpt2": ("gpt2", {}, TOKENS, 2, []),
    "gpt2-wrapped": ("gpt2", {"wrapped": True}, TOKENS, 3, []),
    "llama": ("llama", {}, TOKENS, 2, ["model.layers.1"]),
    "bert": ("bert", {}, CLASSES, 2, []),
    "dict": ("dict_model", {}, {}, 2, []),
}
# T5 (its embedding the encoder's, the decoder's and the head's, held by no stage under its
# own name, `shared`) and torch's TransformerEncoder (cloned layers, a non-persistent buffer)
# are the conformance slice's (tests/test_conformance.py: gradients, tied ones included, and
# the output loading strictly); a tied pair across a world's stages is GPT-2's here.
# Cut and run in this process, each stage a pickled copy as the master ships it: the same
# cut, without a world's start-up (each imports transformers or timm: tens of seconds here).
IN_PROCESS: dict[str, tuple[str, dict[str, Any], tuple[int, ...], int]] = {
    "llama-wrapped": ("llama", {"wrapped": True}, (4, brought.SEQ), 3),
    "timm-resnet": ("timm_model", {"name": "resnet10t"}, (4, 3, 32, 32), 2),
    "timm-convnext": ("timm_model", {"name": "convnext_atto"}, (4, 3, 32, 32), 2),
    "timm-vit": ("timm_model", {"name": "vit_tiny_patch16_224", **VIT}, (4, 3, 32, 32), 3),
}


def loads_back(
    factory: str,
    args: dict[str, Any],
    states: list[dict[str, torch.Tensor]],
    rest: dict[str, torch.Tensor],
    config: dict[str, Any] | None,
    out: Path,
) -> None:
    """Written as spec.output writes it, a fresh model from the factory loads the file
    strictly (and its class `from_pretrained` the folder, for a Hugging Face model)."""
    trained_model.write(out, "safetensors", states, rest, {"job": out.name}, config)
    fresh = getattr(brought, factory)(**args)
    fresh.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    mine = fresh.state_dict()
    for key, value in states[-1].items():
        torch.testing.assert_close(mine[key], value.to(mine[key].dtype), msg=key)
    if config is not None:
        loaded = type(fresh).from_pretrained(out)
        for key, value in mine.items():
            torch.testing.assert_close(loaded.state_dict()[key].to(value.dtype), value, msg=key)


# What crosses the boundary is proven by gpt2 (ModelOutputs, the tied pair) and dict in
# `make test`; an encoder (bert), a wrapper over 3 stages and split points given by name are
# `slow` variants.
@pytest.mark.parametrize("name", exhaustive(WORLDS, {"gpt2", "dict"}))
def test_a_brought_model_trains_exactly_and_loads_back(name: str, tmp_path: Path):
    factory, args, data, stages, points = WORLDS[name]
    fields: dict[str, Any] = {
        "model": {"import": f"userpkg.brought:{factory}", "args": args},
        "stages": stages,
        "steps": 1,
        "microBatches": 2,
    }
    if data:
        fields["data"] = data
    if points:
        fields["splitPoints"] = points
    job = spec.parse(pipeline_job(f"brought-{name}", **fields))
    got = check_gradients(job, tmp_path, timeout=200)  # each process imports transformers
    if points:
        assert [s[0] for s in got["stages"][1:]] == points
    if name.startswith(("gpt2", "llama")):  # a boundary between blocks, inside any wrapper
        assert any(".h." in u or ".layers." in u for u in got["stages"][0] + got["stages"][1])
    loads_back(factory, args, got["states"], got["rest"], got["config"], tmp_path / "model")


@pytest.mark.parametrize("name", list(IN_PROCESS))
def test_a_brought_model_cut_computes_its_gradients(name: str, tmp_path: Path):
    factory, args, shape, stages = IN_PROCESS[name]
    default = torch.get_default_dtype()
    torch.set_default_dtype(EXACT)  # as jobrun.check_gradients: the algorithm, not rounding
    try:
        torch.manual_seed(0)
        model = getattr(brought, factory)(**args)
        g = torch.Generator().manual_seed(1)
        if len(shape) == 2:  # token ids, and the next token as labels
            x = torch.randint(brought.VOCAB, shape, generator=g)
            y = torch.randint(brought.VOCAB, shape, generator=g)
        else:
            x, y = torch.randn(shape, generator=g), torch.randint(10, (shape[0],), generator=g)
        traced = Traced(model, want=2 * stages)
        n = len(traced.units)
        starts = [traced.units[k * n // stages] for k in range(1, stages)]
        shipped = [pickle.loads(pickle.dumps(s)) for s in traced.split(starts)]
        outputs = []
        for part in x.tensor_split(2):  # two micro-batches, as the pipeline runs them
            values = (part,)
            for stage in shipped:
                values = stage(*values)
            outputs.append(values)
        loss = cross_entropy(join(outputs), y)
        loss.backward()
        with without_cache(model):
            expected = cross_entropy(join([model(p) for p in x.tensor_split(2)]), y)
        expected.backward()
    finally:
        torch.set_default_dtype(default)
    assert loss.item() == pytest.approx(expected.item(), rel=TOLERANCE)
    grads = {k: p.grad for s in shipped for k, p in s.named_parameters()}
    params = dict(model.named_parameters())
    assert sorted(grads) == sorted(params)
    for key, p in params.items():
        assert_gradient_close(key, grads[key], p.grad)
    states = [s.state_dict() for s in shipped]
    loads_back(factory, args, states, unused(model, shipped), None, tmp_path / "model")


def test_held_out_figures_follow_the_shapes_not_the_model():
    """A language model's logits, whatever made them (a ModelOutput here), are scored per
    token: loss, accuracy over tokens, perplexity; a classifier's per sample; a figure that
    cannot be computed (a tuple output) is left out, never shown as 0."""
    from transformers.modeling_outputs import CausalLMOutput

    from pipejob.trainer.workloads.metrics import CLASSIFICATION, Tally

    labels = torch.tensor([[1, 2, 3], [3, 2, 1]])
    scores = torch.nn.functional.one_hot(torch.tensor([[1, 2, 0], [3, 2, 1]]), 4).float()
    language = Tally(CLASSIFICATION)  # data that does not say (an import); the shapes tell
    language.add(CausalLMOutput(logits=scores * 10), labels, cross_entropy)
    got = language.result()
    assert got["accuracy"] == pytest.approx(5 / 6) and got["samples"] == 2
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-4)

    classifier = Tally(CLASSIFICATION)
    classifier.add({"logits": scores[0]}, torch.tensor([1, 2, 3]), cross_entropy)
    assert classifier.result()["accuracy"] == pytest.approx(2 / 3)
    assert "perplexity" not in classifier.result()

    def first(outputs, labels):
        return cross_entropy(outputs[0], labels)

    tuples = Tally(CLASSIFICATION)
    tuples.add((scores[0], scores[1]), torch.tensor([1, 2, 3]), first)
    assert sorted(tuples.result()) == ["loss", "samples"]


def test_models_refused_before_are_planned():
    """Mamba (its mixer's initialisation makes tensors on its parameters' device) builds with
    none of its parameters in memory, and Mixtral (its experts' grouped matmul, whose meta
    kernel wants bfloat16 where the CPU's takes float32) passes the master's fit check
    (issue 30)."""
    from pipejob.trainer.pipeline.shape_check import fits_model
    from pipejob.trainer.workloads import materialize

    def mamba():
        torch.manual_seed(0)
        return brought.mamba()

    plain = mamba()
    model, made = materialize.build(mamba, ())
    assert all(p.device.type == "meta" for p in model.parameters())
    numbered = materialize.numbering(model, made)
    keep = materialize.numbers(numbered, ["model.backbone.layers.1.mixer.A_log"])
    part, _ = materialize.build(mamba, keep)
    assert torch.equal(
        part.model.backbone.layers[1].mixer.A_log, plain.model.backbone.layers[1].mixer.A_log
    )

    mixtral, _ = materialize.build(brought.mixtral, ())
    ids = torch.randint(brought.VOCAB, (2, brought.SEQ))
    fits_model(mixtral, ids, ids, cross_entropy)  # no refusal


def test_a_model_refused_before_trains_evaluates_and_writes_its_output(tmp_path: Path, monkeypatch):
    """Issue 30: Inception's shape (an auxiliary head in training only, a named tuple of both
    logits across the micro-batches, the main logits alone in evaluation) with weight-normed
    convolutions, the user's loss main + 0.4 aux: a job trains it to the end, evaluates it
    and writes a model that loads strictly into a fresh one."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    out = tmp_path / "model"
    job = pipeline_job(
        "auxiliary",
        model={"import": "userpkg.brought:auxiliary"},
        loss={"import": "userpkg.brought:auxiliary_loss"},
        steps=3,
        microBatches=2,
        eval={"batches": 1},
        output={"path": str(out)},
    )
    code, said, summary = run_to_end(job, tmp_path, timeout=240)
    assert code == 0, said[-3000:]
    assert summary is not None and math.isfinite(summary["evaluation"]["loss"])
    assert "accuracy" in summary["evaluation"]
    brought.auxiliary().load_state_dict(load_file(out / "model.safetensors"), strict=True)


# slow: a world per model; test_a_model_refused_before_trains_evaluates_and_writes_its_output
# trains one
@pytest.mark.slow
def test_models_refused_at_their_build_before_train_to_the_end(tmp_path: Path, monkeypatch):
    """Issue 30: Mamba (refused at build: "Cannot copy out of meta tensor") and Mixtral
    (refused by the fit check), their logits summed, train in 2 stages (one each) to the
    end in one job; that their stages compute each model exactly is the conformance
    slice's (tests/test_conformance.py)."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    job = pipeline_job(
        "mamba-mixtral",
        model={"import": "userpkg.brought:mamba_and_mixtral"},
        data=TOKENS,
        splitPoints=["models.1"],
        steps=2,
        microBatches=2,
    )
    code, said, summary = run_to_end(job, tmp_path, timeout=240)
    assert code == 0, said[-3000:]
    assert summary is not None and summary["steps"] == 2, summary
    assert math.isfinite(summary["finalLoss"]), summary


@pytest.mark.slow  # a world: the output's loading in test_sharded_output.py
def test_a_model_that_reads_its_version_loads_from_every_output(tmp_path: Path):
    """torchvision's MNASNet refuses a state dict without its modules' versions (its
    `_metadata`): the output a job writes (torch's format: the file alone loads), and what
    `pipejob export` writes from its checkpoint (safetensors, one file or sharded; torch's
    format sharded), each load strictly into a fresh build, with the trained values."""
    from torchvision.models import mnasnet0_5

    out, ckpt = tmp_path / "model", tmp_path / "checkpoints"
    model = {"import": "torchvision.models:mnasnet0_5", "args": {"num_classes": 10}}
    job = pipeline_job(
        "mnasnet",
        model=model,
        steps=1,
        microBatches=2,
        output={"path": str(out), "format": "torch"},
        checkpoint={"path": str(ckpt), "everySteps": 1},
    )
    code, said, _ = run_to_end(job, tmp_path, timeout=240)
    assert code == 0, said[-3000:]
    found = checkpoint.latest(ckpt)
    assert found is not None
    trained = dict(found.load("master.pt")["rest"])
    for i in range(found.manifest["stageCount"]):
        trained |= found.load(f"stage{i}.pt")["model"]
    plain = dict(mnasnet0_5(num_classes=10).state_dict()._metadata)
    loaded = {"run": torch.load(out / "model.pt", weights_only=True)}
    for format, limit in [("safetensors", None), ("safetensors", 0), ("torch", 0)]:
        folder = tmp_path / f"{format}-{limit}"
        trained_model.export_checkpoint(found.directory, found.manifest, folder, format, limit)
        loaded[folder.name] = load_state_dict(folder)
    for name, state in loaded.items():
        fresh = mnasnet0_5(num_classes=10)
        fresh.load_state_dict(state, strict=True)  # MNASNet raises without its version
        assert getattr(state, "_metadata", None) == plain, name
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, trained[key]), (name, key)
