"""`spec.engine: auto` (issue 61): the spec's defaults and world for it, the master's choice
(pipelining where the stages pass each other only tensors, rpc where the cut must pass other
values), and a job that takes the rpc engine by itself in a world seated for either."""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from userdata import BYTE_VOCAB, write_stdlib_tokens

from jobrun import pipeline_job, run_to_end
from pipejob.core import plan, spec
from pipejob.core.kinds.pipeline_schedules import engine_line
from pipejob.trainer.pipeline.engine_choice import Choice, choose, for_inputs, resolved

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

TRANSFORMER = {"vocabSize": BYTE_VOCAB, "layers": 2, "width": 32, "heads": 2, "seqLen": 32}


def settings(**fields):
    return spec.parse(pipeline_job("auto", engine="auto", **fields)).settings


def test_auto_is_the_default():
    """A PipelineJob that names no engine runs on auto (issue 61), its stages seated for
    either engine; one that names rpc keeps its dp groups only with replicas."""
    job = spec.parse(pipeline_job("default", replicas=2, microBatches=2))
    assert job.spec["engine"] == "auto" and job.settings.engine == "auto"
    assert job.spec["schedule"] == "1f1b"
    assert [name for name, _, _ in plan.groups(job, plan.members(job))] == ["pipe"]
    rpc = spec.parse(pipeline_job("rpc", engine="rpc", replicas=2, microBatches=2))
    assert [name for name, _, _ in plan.groups(rpc, plan.members(rpc))] == ["dp0", "dp1"]


def test_auto_runs_1f1b_where_the_count_lets_it_and_seats_the_stages_for_either_engine():
    assert settings(microBatches=4).schedule == "1f1b"
    assert settings(microBatches="auto").schedule == "1f1b"
    assert settings(microBatches=1).schedule == "gpipe"  # 1f1b needs at least `stages`
    assert settings(microBatches=4, schedule="gpipe").schedule == "gpipe"
    job = spec.parse(pipeline_job("auto", engine="auto", replicas=2, microBatches=2))
    groups = [name for name, _, _ in plan.groups(job, plan.members(job))]
    assert groups == ["pipe"]  # every stage of every replica, divided on the stages
    assert engine_line(job.settings).startswith("engine auto: pipelining (schedule 1f1b) where")
    assert engine_line(replace(job.settings, engine="rpc", schedule="gpipe")) == (
        "engine rpc, schedule gpipe"
    )


def test_auto_chooses_pipelining_unless_the_cut_must_pass_other_values():
    units = ["embed", "blocks.0.norm1", "blocks.0.qkv", "blocks.0.proj", "norm"]
    starts = [True, False, False, True, True]  # ints go into norm1 and qkv
    job = settings(microBatches=4, stages=2)
    assert choose(job, units, starts, None).engine == "pipelining"
    fixed = [range(0, 2), range(2, 5)]  # a split point at blocks.0.qkv
    choice = choose(job, units, starts, fixed)
    assert choice.engine == "rpc"
    assert choice.why == (
        "the model passes values other than tensors (ints, tuples) where blocks.0.qkv begin;"
        " rpc runs gpipe, not 1f1b"
    )
    assert resolved(job, "rpc").schedule == "gpipe" and resolved(job, "rpc").engine == "rpc"
    four = settings(microBatches=4, stages=4)
    assert choose(four, units, starts, None).engine == "rpc"  # 3 places for 4 pieces
    interleaved = settings(
        microBatches=4, stages=2, schedule="interleaved-1f1b", stagesPerProcess=2
    )
    assert choose(interleaved, units, starts, fixed).engine == "pipelining"  # refused there


def test_auto_takes_rpc_for_a_loss_not_known_to_be_a_mean_over_samples():
    """The pipelining engine weighs each micro-batch's loss 1/microBatches: exact for a mean
    over samples (pipejob's own, torch's mean-reduced losses), not for a sum."""
    units, starts = ["a", "b", "c"], [True, True, True]
    for loss, engine in (
        (None, "pipelining"),
        ({"import": "torch.nn:MSELoss"}, "pipelining"),
        ({"import": "torch.nn:MSELoss", "args": {"reduction": "sum"}}, "rpc"),
        ({"import": "torch.nn:CrossEntropyLoss", "args": {"weight": [1.0, 2.0]}}, "rpc"),
        ({"import": "userpkg.losses:focal"}, "rpc"),
    ):
        job = settings(microBatches=2, **({"loss": loss} if loss else {}))
        assert choose(job, units, starts, None).engine == engine, loss
    job = spec.parse(pipeline_job("auto", engine="auto", loss={"import": "userpkg.losses:focal"}))
    assert engine_line(job.settings) == (
        "engine auto: rpc (gpipe): spec.loss userpkg.losses:focal is not known to be a mean over"
        " the batch's samples, which the pipelining engine's per-micro-batch losses need (name"
        " spec.engine pipelining where it is one)"
    )


def test_auto_takes_rpc_for_inputs_only_its_stages_carry_as_they_are():
    """A dict or a tensor subclass (MONAI's MetaTensor) from the data: the rpc engine's
    stages carry it as one process sees it; the pipelining engine's take plain tensors."""

    class Tagged(torch.Tensor):
        pass

    job = settings(microBatches=1)
    assert for_inputs(job, torch.zeros(2, 3)) is None  # the cut decides
    assert for_inputs(job, {"ids": torch.zeros(2, 3)}) == Choice(
        "rpc", "the data's inputs are a dict, which only the rpc engine's stages carry as they are"
    )
    subclass = for_inputs(settings(microBatches=2), torch.zeros(2, 3).as_subclass(Tagged))
    assert subclass == Choice(
        "rpc",
        "the data's inputs are Tagged, which only the rpc engine's stages carry as they are;"
        " rpc runs gpipe, not 1f1b",
    )
    rpc = spec.parse(pipeline_job("r", engine="rpc")).settings
    assert for_inputs(rpc, {"ids": torch.zeros(2, 3)}) is None


@pytest.mark.timeout(400)
def test_a_split_where_ints_cross_takes_the_rpc_engine_with_replicas(tmp_path: Path):
    """The transformer passes ints into blocks.0.qkv: a split point there runs on rpc (its
    replicas averaging in the groups of a world seated for pipelining) and trains."""
    tokens = tmp_path / "train.bin"
    write_stdlib_tokens(tokens, max_bytes=20_000)
    manifest = pipeline_job(
        "auto-rpc",
        model={"transformer": TRANSFORMER},
        engine="auto",
        splitPoints=["blocks.0.qkv"],
        replicas=2,
        microBatches=2,
        batchSize=8,
        steps=2,
        seed=3,
        data={"tokens": {"train": str(tokens)}, "workers": 1},
    )
    code, out, summary = run_to_end(manifest, tmp_path, timeout=360)
    assert code == 0, out[-3000:]
    assert "engine auto chose rpc: the model passes values other than tensors" in out, out
    assert summary is not None and summary["engine"] == "rpc" and summary["schedule"] == "gpipe"
    assert summary["engineChosen"].endswith("where blocks.0.qkv begin; rpc runs gpipe, not 1f1b")
    assert summary["replicas"] == 2 and summary["replicaDivergence"] == 0.0


def test_auto_takes_rpc_for_labels_the_cross_entropy_leaves_out():
    """A label at the cross-entropy's ignore_index (padding, a prompt's tokens) leaves
    micro-batches counting different numbers of labels: the pipelining engine's mean of
    their means is not the batch's mean, the rpc engine's one loss is."""
    tokens = torch.tensor([[5, 6, -100], [7, 8, 9]])
    job = settings(microBatches=2)
    assert for_inputs(job, torch.zeros(2, 3), tokens[1:]) is None  # every label counts
    assert for_inputs(job, torch.zeros(2, 3), tokens.float()) is None  # targets, not classes
    chosen = for_inputs(job, torch.zeros(2, 3), tokens)
    assert chosen is not None and chosen.engine == "rpc"
    assert chosen.why.startswith("the data's labels hold the cross-entropy's ignore_index (-100)")
    assert chosen.why.endswith("; rpc runs gpipe, not 1f1b")
    own = settings(microBatches=2, loss={"crossEntropy": {"ignoreIndex": 0}})
    assert for_inputs(own, torch.zeros(2, 3), tokens) is None
    assert for_inputs(own, torch.zeros(2, 3), tokens.clamp(min=0)).engine == "rpc"
    torch_loss = settings(
        microBatches=2, loss={"import": "torch.nn:CrossEntropyLoss", "args": {"ignore_index": 9}}
    )
    assert for_inputs(torch_loss, torch.zeros(2, 3), tokens).engine == "rpc"
    assert (
        for_inputs(
            settings(microBatches=2, loss={"import": "torch.nn:MSELoss"}), torch.zeros(2, 3), tokens
        )
        is None
    )
    named = spec.parse(pipeline_job("p", engine="pipelining", microBatches=2)).settings
    assert for_inputs(named, torch.zeros(2, 3), tokens) is None


# ------------------------------------------------------------------ the examples' choices

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# The engine each PipelineJob example runs on, as the user guide's "Pipeline engines and
# schedules" says: auto's choice where the example names none.
EXAMPLE_ENGINES = {
    "coscheduling-pipeline.yaml": "pipelining",
    "custom-model/pipelinejob.yaml": "pipelining",
    "hf-causal-lm/pipelinejob.yaml": "rpc",  # GPT-2's blocks pass more than tensors
    "kueue-pipeline.yaml": "pipelining",
    "lora-causal-lm/pipelinejob.yaml": "pipelining",  # Llama in 2 stages: tensors between
    "resnet50-pipeline-gpu.yaml": "pipelining",
    "resnet50-pipeline.yaml": "pipelining",
    "resnet50-pipelining.yaml": "pipelining",  # named
    "transformer-lm/pipelinejob.yaml": "pipelining",
}


def example_choice(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Choice:
    """auto's choice for an example as its master makes it, in this process: its model and
    two samples of its data (read where `pipejob run` reads them), its cut's candidates
    passed a micro-batch once (benchmarks/_conform_engine.py); a named engine as named."""
    from _conform_engine import auto_engine

    from pipejob.trainer.workloads import data, models

    folder = tmp_path / Path(name).parent.name
    if Path(name).parent != Path("."):  # its own code and data, beside its manifest
        shutil.copytree(EXAMPLES / Path(name).parent, folder)
        monkeypatch.syspath_prepend(str(folder))
        monkeypatch.chdir(folder)
    if name.startswith("lora-causal-lm/"):  # what its base.py writes before a run
        import base

        base.write_base(folder / "base", layers=2, width=64)
        base.write_tokens(folder / "data", max_bytes=20_000)
    job = spec.parse(yaml.safe_load((EXAMPLES / name).read_text())).settings
    if job.engine != "auto":
        return Choice(job.engine, "named")
    assert not job.split_points and job.model.cut != "eager"  # else the choice needs them
    try:
        inputs, labels = data.sample(job, 2)
        return auto_engine(lambda: models.build(job), inputs, job.pieces, lambda _: job, labels)
    finally:  # two examples have a stdlib_text of their own
        for module in [
            m for m, v in sys.modules.items() if str(folder) in str(vars(v).get("__file__"))
        ]:
            del sys.modules[module]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(EXAMPLE_ENGINES))
def test_every_example_runs_on_the_engine_the_guide_says(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Every PipelineJob example is listed, and auto chooses for it the engine the user
    guide says (the master's own functions, without a world)."""
    listed = {
        str(p.relative_to(EXAMPLES))
        for p in EXAMPLES.glob("**/*.yaml")
        if yaml.safe_load(p.read_text()).get("kind") == "PipelineJob"
    }
    assert listed == set(EXAMPLE_ENGINES)
    choice = example_choice(name, tmp_path, monkeypatch)
    assert choice.engine == EXAMPLE_ENGINES[name], choice
