"""The eager path (trainer/pipejob/trainer/pipeline/eager/): the master runs the model's own
forward and calls its costly modules where they live on the stages. In process: the
placement, its one-process check, the stages' micro-batch order, the spec's refusal. One
world: an ESM-2-like encoder the trace refuses takes the eager path by itself and its first
step equals one process's in float64 (loss and every parameter after one SGD step)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from userpkg import esmlike

from jobrun import pipeline_job, run_to_end
from pipejob.core import spec
from pipejob.trainer import workloads
from pipejob.trainer.pipeline.eager.check import check
from pipejob.trainer.pipeline.eager.placement import no_grad_run, place
from pipejob.trainer.pipeline.eager.turns import Turns
from pipejob.trainer.runtime import model_files
from pipejob.trainer.workloads import data, models

TESTS = Path(__file__).parent


def _tokens() -> torch.Tensor:
    return torch.stack([esmlike.sequences("train")[i][0] for i in range(4)])


def test_placement_follows_the_forward_and_keeps_the_models_names():
    """ESM's layers sit in a ModuleList the forward never calls itself: it opens into them;
    the stages get contiguous runs in the order the forward calls them."""
    torch.manual_seed(0)
    model = esmlike.esm2()
    placement = place(model, no_grad_run(model, _tokens()), 2)
    assert placement.remote() == [
        "embed_tokens",
        "layers.0",
        "layers.1",
        "layers.2",
        "layers.3",
        "emb_layer_norm_after",
        "head",
    ]
    assert all(placement.stages) and placement.kept == {}


class DeepSupervised(nn.Module):
    """As MONAI's DynUNet: a layer writes a head's output into a list made when the model
    was (so it holds the last batch's head, not this one's, where the layer runs elsewhere)
    and that the forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.heads: list[torch.Tensor] = [torch.zeros(1)]
        self.down = Writes(self.heads)
        self.mid = nn.Linear(4, 4)
        self.up = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.up(self.mid(self.down(x)))
        return self.out(x + self.heads[0])


class Writes(nn.Module):
    def __init__(self, heads: list[torch.Tensor]) -> None:
        super().__init__()
        self.heads = heads
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.heads[0] = y * 2
        return y


def test_a_module_writing_state_the_glue_reads_stays_with_the_glue():
    model = DeepSupervised()
    run, other = no_grad_run(model, torch.randn(3, 4)), no_grad_run(model, torch.randn(3, 4))
    placement = check(model, run, lambda kept: place(model, run, 2, kept), other)
    assert "down" in placement.kept and "Python state" in placement.kept["down"]
    assert "down" not in placement.remote() and all(placement.stages)


def test_a_stage_computes_a_modules_micro_batches_in_order():
    """Micro-batch 1's call waits for micro-batch 0's, or for its forward's end without it."""
    turns, order = Turns(), []

    def call(number: int) -> None:
        turns.wait(("layer", 0), 10, number, timeout=10)
        order.append(number)
        turns.made(("layer", 0), number)

    later = threading.Thread(target=call, args=(12,))
    later.start()
    later.join(0.2)
    assert later.is_alive()  # 10 and 11 have not called yet
    call(10)
    turns.ended(11)  # 11's forward ended without calling the layer
    later.join(10)
    assert order == [10, 12]


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, the first and last modules."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.embed(tokens)))


def test_a_weight_used_in_two_places_lives_in_one():
    model = Tied()
    placement = place(model, no_grad_run(model, torch.randint(16, (2, 5))), 2)
    where = placement.stage_of()
    assert where["out"] == where["embed"] == 0
    assert len(placement.stages) == 2 and all(placement.stages)


def test_plan_says_the_path_where_the_spec_asks_for_it():
    job = spec.parse(_esm_job(model={"import": "userpkg.esmlike:esm2", "cut": "eager"}))
    assert any(line.startswith("path: eager") for line in job.definition.describe(job.spec))
    job = spec.parse(_esm_job())
    assert not any(line.startswith("path:") for line in job.definition.describe(job.spec))


def test_what_the_eager_path_does_not_carry_is_refused_naming_the_field_never_ignored():
    from pipejob.trainer.pipeline.eager.run import refusal

    assert refusal(spec.parse(_esm_job()).settings) is None
    refused = refusal(spec.parse(_esm_job(gradientAccumulation=2)).settings)
    assert refused is not None and "spec.gradientAccumulation" in refused
    refused = refusal(spec.parse(_esm_job(replicas=2)).settings)
    assert refused is not None and "spec.replicas" in refused
    refused = refusal(spec.parse(_esm_job(ema={"decay": 0.9})).settings)
    assert refused is not None and "spec.ema" in refused
    refused = refusal(spec.parse(_esm_job(eval={"best": {}})).settings)
    assert refused is not None and "spec.eval.best" in refused


def test_the_eager_path_on_the_pipelining_engine_is_refused_naming_the_field():
    manifest = pipeline_job(
        "e", model={"import": "userpkg.esmlike:esm2", "cut": "eager"}, engine="pipelining"
    )
    with pytest.raises(ValueError, match=r"spec.model.cut: the eager path .* rpc engine only"):
        spec.parse(manifest)


def _esm_job(**fields) -> dict:
    defaults = {
        "model": {"import": "userpkg.esmlike:esm2"},
        "data": {"import": "userpkg.esmlike:sequences"},
        "stages": 2,
        "batchSize": 8,
        "microBatches": 4,
        "numClasses": 5,
        "optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0},
    }
    return pipeline_job("esm", **(defaults | fields))


def _one_process_step(manifest: dict, lr: float) -> tuple[float, dict[str, torch.Tensor]]:
    """Step 1 of the job in one process: its loss, and every parameter after one SGD step."""
    s = spec.parse(manifest).settings
    model = models.build(s)
    with data.Feed(s) as feed:
        inputs, labels = feed.batch()
    m, loss_fn = s.micro_batches, workloads.loss(s)
    loss = sum(
        loss_fn(model(x), y) * (len(y) / len(labels))
        for x, y in zip(inputs.tensor_split(m), labels.tensor_split(m), strict=True)
    )
    loss.backward()
    return loss.item(), {n: (p - lr * p.grad).detach() for n, p in model.named_parameters()}


def test_a_model_the_trace_refuses_trains_on_the_eager_path_as_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    out = tmp_path / "out"
    manifest = _esm_job(steps=1, output={"path": str(out)})
    code, output, summary = run_to_end(manifest, tmp_path, timeout=240)
    assert code == 0, output[-3000:]
    assert summary is not None and summary["path"] == "eager"
    # engine auto, the default: the eager path's engine, said as the cut's choice is
    assert summary["engine"] == "rpc" and summary["engineChosen"] == "the eager path runs on rpc"
    assert "engine auto chose rpc: the eager path runs on rpc" in output
    assert summary["pathReason"].startswith("the trace was refused")
    assert "padding_mask.any()" in summary["pathReason"]
    assert summary["glueParameters"] == 0  # every module with parameters lives on a stage
    loss, expected = _one_process_step(manifest, lr=0.5)
    assert summary["losses"][0] == pytest.approx(loss, rel=1e-12)
    trained = model_files.load_state_dict(out)
    assert sorted(trained) == sorted(models.build(spec.parse(manifest).settings).state_dict())
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-12, atol=1e-12, msg=name)


def _losses_and_evaluation(manifest: dict, tmp_path: Path, name: str) -> tuple[list, dict]:
    code, output, summary = run_to_end(manifest, tmp_path / name, timeout=240)
    assert code == 0 and summary is not None, output[-3000:]
    return summary["losses"], summary["evaluation"]


@pytest.mark.slow  # two more worlds; the path, placement and exact step: the test above
def test_a_run_stopped_and_resumed_on_the_eager_path_gives_the_straight_runs_bits(
    tmp_path, monkeypatch
):
    """Adam (state in every process), evaluation, a checkpoint at step 2: steps 3-4 resumed
    from it give the losses and held-out figures of a straight run of 4, to the bit."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    for name in ("straight", "stopped", "resumed"):
        (tmp_path / name).mkdir()

    def job(steps: int, path: Path) -> dict:
        return _esm_job(
            model={"import": "userpkg.esmlike:esm2", "cut": "eager"},
            optimizer={"name": "adam", "lr": 0.01},
            steps=steps,
            eval={"everySteps": 2},
            checkpoint={"path": str(path), "everySteps": 2},
        )

    straight, evaluated = _losses_and_evaluation(job(4, tmp_path / "a"), tmp_path, "straight")
    stopped, _ = _losses_and_evaluation(job(2, tmp_path / "b"), tmp_path, "stopped")
    resumed, again = _losses_and_evaluation(job(4, tmp_path / "b"), tmp_path, "resumed")
    assert stopped + resumed == straight
    assert again == evaluated


def test_the_conformance_harness_tries_a_refused_model_on_the_eager_path(monkeypatch):
    """The ESM-like encoder, which the trace refuses: exact on the eager path (benchmarks/
    _conform_eager.py); with the eager path's gradients broken, still refused, saying why."""
    import sys

    monkeypatch.syspath_prepend(str(TESTS.parent / "benchmarks"))
    sys.modules.pop("_conform", None)
    import _conform
    import _conform_eager

    row = _conform.run("esm", "esm2", lambda: esmlike.ESM2(num_layers=2), _tokens)
    assert row.verdict == "eager", row
    assert row.why.startswith("the trace refused it") and row.cuts.startswith("eager: ")

    # The embedding's stage gives its output without its graph: it gets no gradient.
    class Detached(_conform_eager._Copying):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            return out.detach() if isinstance(self.held, nn.Embedding) else out

    monkeypatch.setattr(_conform_eager, "_Copying", Detached)
    row = _conform.run("esm", "esm2", lambda: esmlike.ESM2(num_layers=2), _tokens)
    assert row.verdict == "refused", row
    assert "on the eager path: (c) eager: embed_tokens.weight got no gradient" in row.why, row
