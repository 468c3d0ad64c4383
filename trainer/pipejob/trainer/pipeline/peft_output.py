"""A peft model's output as peft users expect it, beside the whole model's files: the
adapters as `PeftModel.save_pretrained` writes them, and on request (spec.output.merged) the
model with the LoRA adapters merged, in `merged/` (the user guide's "Fine-tuning"). Both are
read from the model files just written, one file at a time for a safetensors output (a
torch one is read whole); no peft needed: the names and arithmetic are peft's own
(get_peft_model_state_dict, LoraLayer.merge for Linear), checked by tests/test_lora.py."""

from __future__ import annotations

import enum
import json
import math
from pathlib import Path
from typing import Any, TypedDict

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from pipejob.trainer.runtime import model_files
from pipejob.trainer.runtime.json_values import JsonObject

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MERGED = "merged"
PREFIX = "base_model.model."  # where a PeftModel holds its base model


class AdapterConfig(TypedDict):
    """An adapter's config as adapter_config.json holds it (peft's LoraConfig.to_dict(),
    plain): the fields the merge reads; it holds peft's others too, written as they are."""

    r: int
    lora_alpha: float
    fan_in_fan_out: bool
    use_rslora: bool
    use_dora: bool
    bias: str  # "none", "all" or "lora_only"
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]


def configs(model: nn.Module) -> dict[str, AdapterConfig] | None:
    """A peft model's adapters' configs by adapter name, as adapter_config.json holds them
    (None for any other model)."""
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict) or not hasattr(model, "base_model"):
        return None
    return {name: _plain(config.to_dict()) for name, config in peft_config.items()}


def _plain(value: Any) -> Any:
    """As JSON holds it: sets as sorted lists (peft's own save_pretrained does so), enums as
    their values."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


def adapter_state(state: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """Adapter `name`'s weights under the names peft saves them (get_peft_model_state_dict:
    the LoRA matrices, the adapter's name left out)."""
    mark = f".{name}."
    return {
        k.replace(f".{name}", ""): v.contiguous()
        for k, v in state.items()
        if "lora_" in k and mark in k
    }


def merged_state(
    state: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], name: str, config: AdapterConfig
) -> dict[str, torch.Tensor]:
    """The base model's tensors of `state` (the whole model's, or a file's share) with
    adapter `name` (its LoRA matrices in `lora`, under the model's names) merged into each
    adapted Linear's weight (W + scaling B A, as peft's merge; transposed for fan_in_fan_out
    layers), under the base model's names; refused, saying why, for what peft's LoRA merge
    does otherwise."""
    scaling = _scaling(name, config)
    merged: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if "lora_" in key:
            continue
        base = key.removeprefix(PREFIX).replace(".base_layer.", ".")
        module = key.removesuffix(".base_layer.weight")
        a = lora.get(f"{module}.lora_A.{name}.weight")
        b = lora.get(f"{module}.lora_B.{name}.weight")
        if module != key and a is not None and b is not None:
            delta = (b.double() @ a.double()) * scaling
            delta = delta.T if config.get("fan_in_fan_out") else delta
            value = (value.double() + delta).to(value.dtype)
        merged[base] = value.contiguous()
    return merged


def _scaling(name: str, config: AdapterConfig) -> float:
    """The adapter's scaling (lora_alpha over r, or over its root with rsLoRA), refused where
    peft's merge does more than W + scaling B A."""
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(
                f"spec.output.merged: adapter {name!r} has a {key}; merge it"
                " with peft's merge_and_unload"
            )
    if config.get("use_dora") or config.get("bias", "none") != "none":
        raise ValueError(
            f"spec.output.merged: adapter {name!r} uses DoRA or trains biases;"
            " merge it with peft's merge_and_unload"
        )
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / (math.sqrt(r) if config.get("use_rslora") else r)


class Files:
    """The model files of an output folder, each with the names it holds; read by name.
    A torch-format output is read whole (torch.load cannot read part of a file)."""

    def __init__(self, out: Path):
        index = out / model_files.index_name("safetensors")
        single = out / "model.safetensors"
        self.whole: dict[str, torch.Tensor] | None = None
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {
                f: [k for k, g in weight_map.items() if g == f]
                for f in dict.fromkeys(weight_map.values())
            }
        elif single.exists():
            with safe_open(single, "pt") as f:
                self.files = {single.name: list(f.keys())}
        else:
            self.whole = model_files.load_state_dict(out)
            self.files = {"model.safetensors": list(self.whole)}
        self.out = out

    def read(self, file: str, names: list[str]) -> dict[str, torch.Tensor]:
        if self.whole is not None:
            return {k: self.whole[k] for k in names}
        with safe_open(self.out / file, "pt") as f:
            return {k: f.get_tensor(k) for k in names}

    def matching(self, mark: str) -> dict[str, torch.Tensor]:
        """Every tensor whose name holds `mark`, from whichever file holds it."""
        found: dict[str, torch.Tensor] = {}
        for file, names in self.files.items():
            found |= self.read(file, [k for k in names if mark in k])
        return found


def write(
    out: str | Path,
    adapters: dict[str, AdapterConfig],
    merged: bool,
    hf_config: JsonObject | None,
) -> list[Path]:
    """Write the adapters of the model files in `out` (and the merged model, when
    `merged`); the paths written."""
    out = Path(out)
    files = Files(out)
    lora = files.matching("lora_")
    written = []
    for name, config in adapters.items():
        folder = out if name == "default" else out / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        save_file(adapter_state(lora, name), str(folder / ADAPTER_FILE), {"format": "pt"})
        written += [folder / ADAPTER_FILE, folder / ADAPTER_CONFIG]
    if merged:
        name = "default" if "default" in adapters else next(iter(adapters))
        written += _write_merged(files, lora, name, adapters[name], hf_config)
    return written


def _write_merged(
    files: Files,
    lora: dict[str, torch.Tensor],
    name: str,
    config: AdapterConfig,
    hf_config: JsonObject | None,
) -> list[Path]:
    """The merged model in out/merged/, one file per file of the output (read one at a
    time), with an index where there are several; its config.json."""
    folder = files.out / MERGED
    folder.mkdir(exist_ok=True)
    written, shards = [], []
    for file, names in files.files.items():
        state = merged_state(
            files.read(file, [k for k in names if "lora_" not in k]), lora, name, config
        )
        save_file(state, str(folder / file), {"format": "pt"})
        written.append(folder / file)
        shards.append(
            {"file": file, "sizes": {k: v.numel() * v.element_size() for k, v in state.items()}}
        )
        del state
    if len(shards) > 1:
        weight_map = {k: s["file"] for s in shards for k in s["sizes"]}
        total = sum(size for s in shards for size in s["sizes"].values())
        index = folder / model_files.index_name("safetensors")
        index.write_text(
            json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                indent=2,
            )
            + "\n"
        )
        written.append(index)
    if hf_config is not None:
        (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
        written.append(folder / "config.json")
    return written
