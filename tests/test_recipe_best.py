"""spec.eval.best and spec.eval.earlyStopping (issue 58): the rules on sequences of held-out
figures (the Hugging Face Trainer's: any improvement is the new best; patience counts the
evaluations not better by more than minDelta), and a `pipejob run` that stops early at the
step the rule says, successfully, with the best step's weights as its output (its held-out
loss, computed in this one process, is the best evaluation's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torchvision import datasets, transforms

from jobrun import pipeline_job, run_to_end
from pipejob.core import spec
from pipejob.core.best_model import Best, EarlyStopping
from pipejob.trainer.pipeline.best_step import Judge


def judged(values: list[float], best: Best, stopping: EarlyStopping | None) -> tuple[Judge, int]:
    """A Judge after evaluations of `values` (steps 1, 2, ...) until it says stop; the last
    step it saw."""
    judge = Judge(best, stopping)
    for step, value in enumerate(values, start=1):
        judge.judge({"step": step, best.metric: value, "samples": 10})
        if judge.stop_reason() is not None:
            return judge, step
    return judge, len(values)


def test_the_best_and_the_stop_follow_the_hf_trainers_rules():
    loss = Best(metric="loss")
    judge, stopped = judged([2.0, 1.5, 1.6, 1.45, 1.44, 1.7], loss, EarlyStopping(patience=2))
    assert (judge.step, judge.value, stopped) == (5, 1.44, 6)  # 1.7 is one, not two
    judge, stopped = judged(
        [2.0, 1.5, 1.6, 1.45, 1.44, 1.7], loss, EarlyStopping(patience=2, min_delta=0.1)
    )
    # 1.45 and 1.44 better the best, by less than 0.1: the new best, but patience runs out
    assert (judge.step, judge.value, stopped) == (4, 1.45, 4)
    assert judge.stop_reason() == (
        "early stopping: 2 evaluation(s) in a row without bettering the best loss (1.45,"
        " step 4) by more than 0.1"
    )
    judge, stopped = judged([0.5, 0.7, 0.6, 0.71], Best(metric="accuracy"), None)
    assert (judge.step, judge.value, stopped, judge.stop_reason()) == (4, 0.71, 4, None)
    judge, _ = judged([0.5, 0.7, 0.6], Best(metric="accuracy", mode="min"), None)
    assert (judge.step, judge.value) == (1, 0.5)
    with pytest.raises(ValueError, match="spec.eval.best.metric: the evaluation has no"):
        Judge(Best(metric="perplexity"), None).judge({"step": 1, "loss": 1.0, "accuracy": 0.5})


def refusals(manifest: dict[str, Any]) -> list[str]:
    with pytest.raises(spec.InvalidSpec) as refused:
        spec.parse(manifest)
    return [str(e) for e in refused.value.errors]


def test_bad_best_and_early_stopping_are_refused_naming_the_field():
    e = "spec.eval"
    (metric,) = refusals(pipeline_job("bad", eval={"best": {"metric": "auc"}}))
    assert metric.startswith(f"{e}.best.metric: must be one of loss, perplexity, accuracy")
    (mode,) = refusals(pipeline_job("bad", eval={"best": {"mode": "lowest"}}))
    assert mode.startswith(f"{e}.best.mode: must be one of auto, min, max")
    assert refusals(pipeline_job("bad", eval={"earlyStopping": {"patience": 2}})) == [
        f"{e}.earlyStopping: earlyStopping watches best's metric: give best too (best: {{}}"
        " for the loss)"
    ]
    assert refusals(pipeline_job("bad", eval={"best": {}, "earlyStopping": {}})) == [
        f"{e}.earlyStopping.patience: is required"
    ]
    (patience,) = refusals(pipeline_job("bad", eval={"best": {}, "earlyStopping": {"patience": 0}}))
    assert patience.startswith(f"{e}.earlyStopping.patience: must be >= 1")
    (delta,) = refusals(
        pipeline_job("bad", eval={"best": {}, "earlyStopping": {"patience": 1, "minDelta": -1}})
    )
    assert delta.startswith(f"{e}.earlyStopping.minDelta: must be >= 0")
    hybrid = {
        "apiVersion": spec.API_VERSION,
        "kind": "HybridJob",
        "metadata": {"name": "bad"},
        "spec": {"eval": {"best": {}}},
    }
    assert refusals(hybrid) == [
        f"{e}: a HybridJob keeps no best model and stops no run early yet: leave eval.best and"
        " eval.earlyStopping out"
    ]


def held_out_loss(model: torch.nn.Module, folder: Path) -> float:
    """The mean cross-entropy over the held-out images, with the standard transforms."""
    standard = transforms.Compose(
        [
            transforms.Resize(32),
            transforms.CenterCrop(32),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    held = datasets.ImageFolder(str(folder), standard)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(held, batch_size=128):
            total += F.cross_entropy(model(x), y, reduction="sum").item()
    return total / len(held)


def test_a_run_stops_where_the_rule_says_with_the_best_steps_weights_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from safetensors.torch import load_file
    from userdata import write_digits
    from userpkg.vision import small_cnn

    train, val = write_digits(tmp_path / "digits")
    out = tmp_path / "model"
    # The highest loss is the best: the loss falls over the first steps, so the first
    # evaluation stays the best, the run stops at the third, and the output (step 1's
    # weights) is not the last step's: a run that wrote its last weights would fail.
    patience, delta = 2, 0.0
    manifest = pipeline_job(
        "best",
        model={"import": "userpkg.vision:small_cnn", "args": {"classes": 10}},
        data={"imageFolder": {"train": str(train), "val": str(val)}},
        eval={
            "everySteps": 1,
            "best": {"metric": "loss", "mode": "max"},
            "earlyStopping": {"patience": patience, "minDelta": delta},
        },
        output={"path": str(out)},
        stages=2,
        microBatches=2,
        batchSize=32,
        steps=40,
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9},
    )
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # userpkg, for every process
    code, log, summary = run_to_end(manifest, tmp_path, timeout=280)
    assert code == 0, log[-3000:]
    assert summary is not None
    losses = [e["loss"] for e in summary["evaluations"]]
    # The rule, written out: where it ends the run, and the best evaluation before.
    best, stale, stop = None, 0, None
    for step, value in enumerate(losses, start=1):
        better = best is None or value > best
        stale = 0 if better and (best is None or value - best > delta) else stale + 1
        best = value if better else best
        if stale >= patience:
            stop = step
            break
    assert stop is not None, f"the run must stop early: {losses}"
    assert summary["steps"] == stop == len(losses)
    assert summary["stoppedEarly"].startswith(f"early stopping: {patience} evaluation(s)")
    assert summary["best"] == {"metric": "loss", "value": best, "step": losses.index(best) + 1}
    assert summary["best"]["step"] < stop, losses  # the output is not the last step's
    assert f"the run ends after step {stop}" in log
    model = small_cnn(classes=10)
    model.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    assert held_out_loss(model, val) == pytest.approx(best, abs=1e-5)


def test_a_resumed_run_starts_from_the_best_its_output_holds(tmp_path: Path):
    """After a restart the output's model.json (written at the best evaluation) seeds the
    judge: a worse evaluation after the resume is not written over it."""
    import json

    fields = {"eval": {"best": {"metric": "loss"}}, "output": {"path": str(tmp_path)}}
    job = spec.parse(pipeline_job("best", **fields)).settings
    assert Judge.of(job, 10).step is None  # no output yet
    (tmp_path / "model.json").write_text(json.dumps({"evaluation": {"step": 8, "loss": 0.5}}))
    judge = Judge.of(job, 10)
    assert (judge.value, judge.step) == (0.5, 8)
    assert not judge.judge({"step": 12, "loss": 0.6})
    assert Judge.of(job, 0).step is None  # a fresh run: an old output is not its best
    assert Judge.of(job, 7).step is None  # the output is of a step after the checkpoint
