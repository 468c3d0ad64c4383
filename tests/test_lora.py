"""LoRA fine-tuning (issue 41, examples/lora-causal-lm/): a peft model's output is what peft
users expect (pipeline/peft_output.py), checked against peft itself: the adapter files hold what
`PeftModel.save_pretrained` writes, `PeftModel.from_pretrained` loads them and gives the
trained adapters' outputs, and the merged model is peft's `merge_and_unload`. A stage holding
part of a LoRA model steps and checkpoints optimizer state for its adapters only (the frozen
base weights get no gradient and none). The recipe itself runs with `pipejob run` to its end
(`test_the_recipe_trains_and_peft_loads_its_adapters`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from jobrun import pipeline_job
from pipejob.core import spec
from pipejob.trainer.pipeline import peft_output
from pipejob.trainer.pipeline.cut_model import plan_cut
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.runtime import model_files
from pipejob.trainer.workloads import metrics, models

pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(300)

EAGER = "eager"  # the recipe's attention: outputs compared bit for bit
RECIPE = Path(__file__).resolve().parent.parent / "examples" / "lora-causal-lm"


def write_base(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


def lora(base: Path, seed: int = 0) -> torch.nn.Module:
    sys.path.insert(0, str(RECIPE))
    try:
        import lora_lm
    finally:
        sys.path.remove(str(RECIPE))
    return lora_lm.model(str(base), seed=seed)


def trained(model: torch.nn.Module) -> torch.nn.Module:
    """The adapters moved off their initial values (lora_B starts at zero)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def test_adapter_files_and_merge_are_peft_s(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    write_base(base)
    model = trained(lora(base)).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # merge_and_unload: in place
    configs = peft_output.configs(model)
    ids = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = model(ids).logits

    out = tmp_path / "out"  # as a run writes it: the whole model's file, then the adapters
    out.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    config = json.loads(model.config.to_json_string(use_diff=False))
    peft_output.write(out, configs, True, config)

    peft_dir = tmp_path / "peft"  # what peft itself writes
    model.save_pretrained(peft_dir)
    ours, theirs = (
        load_file(out / peft_output.ADAPTER_FILE),
        load_file(peft_dir / peft_output.ADAPTER_FILE),
    )
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key

    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, attn_implementation=EAGER), out
    ).eval()
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)

    merged = AutoModelForCausalLM.from_pretrained(
        out / peft_output.MERGED, attn_implementation=EAGER
    ).eval()
    reference = model.merge_and_unload().state_dict()
    got = merged.state_dict()
    assert sorted(got) == sorted(reference)
    for key, value in reference.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=key)
    torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)

    # A sharded output (a model over the one-file size): read a file at a time, the merged
    # model sharded alike, with its index.
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    shards = [
        model_files.write_shard(
            sharded,
            model_files.shard_name(i + 1, 2, "safetensors"),
            {k: state[k] for k in half},
            "safetensors",
        )
        for i, half in enumerate(halves)
    ]
    model_files.write_index(sharded, shards, {})
    peft_output.write(sharded, configs, True, config)
    assert (sharded / peft_output.MERGED / "model.safetensors.index.json").exists()
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, attn_implementation=EAGER), sharded
    ).eval()
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)
    merged = AutoModelForCausalLM.from_pretrained(
        sharded / peft_output.MERGED, attn_implementation=EAGER
    ).eval()
    torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_a_stage_steps_and_keeps_state_for_its_adapters_only(tmp_path: Path) -> None:
    """Each stage of a 2-stage cut, built as its process builds it: after a step only the
    adapters changed and have optimizer state, in the stage and in its checkpoint."""
    base = tmp_path / "base"
    write_base(base)
    sys.path.insert(0, str(RECIPE))
    try:
        s = spec.parse(
            pipeline_job(
                "lora",
                model={"import": "lora_lm:model", "args": {"base": str(base)}},
                batchSize=4,
                microBatches=1,
                optimizer={"name": "adamw", "lr": 0.01},
            )
        ).settings
        meta, numbered = models.build_meta(s)
        units = plan_units(s, meta)
        from pipejob.trainer.pipeline.cut_model import Partition

        cut = len(units) // 2
        saved = Partition([range(0, cut), range(cut, len(units))], [1.0] * len(units), 1)
        cut_model = plan_cut(s, meta, numbered, [], saved)
        assert cut_model.builders is not None and cut_model.adapters is not None
        stages = [StageBase(part, "cpu", optimizer=s.optimizer) for part in cut_model.builders]
    finally:
        sys.path.remove(str(RECIPE))
    ids = torch.randint(64, (4, 8), generator=torch.Generator().manual_seed(2))
    before = [{k: v.clone() for k, v in st.layers.state_dict().items()} for st in stages]
    values: tuple = (ids,)
    for stage in stages:
        values = stage.pieces[0](*values)
    metrics.cross_entropy(values, ids).backward()
    for k, stage in enumerate(stages):
        assert stage.optimizer is not None
        stage.optimizer.step()
        names = {id(p): n for n, p in stage.layers.named_parameters()}
        with_state = sorted(names[id(p)] for p in stage.optimizer.state)
        adapted = sorted(n for n, p in stage.layers.named_parameters() if p.requires_grad)
        assert with_state == adapted and all("lora_" in n for n in adapted), with_state
        frozen = [n for n, p in stage.layers.named_parameters() if not p.requires_grad]
        assert frozen and all(
            p.grad is None for p in stage.layers.parameters() if not p.requires_grad
        )
        after = stage.layers.state_dict()
        changed = sorted(n for n in after if not torch.equal(after[n], before[k][n]))
        assert changed and all("lora_" in n for n in changed), changed
        entry = stage.save(str(tmp_path / "ckpt"), f"stage{k}.pt")
        saved_state = torch.load(tmp_path / "ckpt" / entry["name"], weights_only=False)
        kept = saved_state["optimizers"]["optimizer"]
        assert sorted(kept) == adapted, sorted(kept)


def plan_units(s, meta) -> list[str]:
    from pipejob.trainer.pipeline.stage_build import trace

    return trace(s, meta).units


@pytest.mark.slow  # a world of three processes importing transformers: minutes here
@pytest.mark.timeout(600)
def test_the_recipe_trains_and_peft_loads_its_adapters(tmp_path: Path) -> None:
    """`python base.py` and `pipejob run pipelinejob.yaml` as the recipe says: the job
    succeeds; PeftModel.from_pretrained(base, out) gives the outputs of the trained model
    (its whole state, as the run wrote it, in the recipe's own peft model); the merged model
    too; the base weights are the base's, untouched."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "lora-causal-lm"
    shutil.copytree(
        RECIPE, folder, ignore=shutil.ignore_patterns("base", "data", "out", "__pycache__")
    )
    subprocess.run(
        [sys.executable, "base.py"], cwd=folder, check=True, timeout=240, capture_output=True
    )
    summary_file = tmp_path / "summary.json"
    result = subprocess.run(
        [sys.executable, "-m", "pipejob.cli", "run", str(folder / "pipelinejob.yaml")],
        env=os.environ | {"PIPEJOB_SUMMARY_FILE": str(summary_file)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = json.loads(summary_file.read_text())
    assert summary["finalLoss"] < summary["losses"][0], summary["losses"]
    out = folder / "out"
    model = lora(folder / "base").eval()
    state = load_file(out / "model.safetensors")
    model.load_state_dict(state, strict=True)
    base = AutoModelForCausalLM.from_pretrained(folder / "base", attn_implementation=EAGER)
    for key, value in base.state_dict().items():  # frozen: the base's own weights
        peft_key = peft_output.PREFIX + key
        if peft_key not in state:
            peft_key = peft_key.replace(".weight", ".base_layer.weight")
        assert torch.equal(state[peft_key], value), key
    ids = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(3))
    expected = model(ids).logits
    loaded = PeftModel.from_pretrained(base, out).eval()
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)
    merged = AutoModelForCausalLM.from_pretrained(
        out / peft_output.MERGED, attn_implementation=EAGER
    ).eval()
    torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-4, atol=1e-4)
