"""Issue 41's models from other libraries, each as a job (userpkg/libraries.py): step 1
through a real 2-stage world equals one process's in float64 (loss and every gradient), and
`pipejob run` trains it to its end and writes an output that a fresh build from the same
factory loads strictly. The packed GRU, the eighth, is test_staged.py's.

Every process of these worlds imports its library (tens of seconds each here), so they are
`slow`; in `make test` each model's cut is held in one process by test_user_libraries.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file
from userpkg import libraries

from jobrun import check_gradients, pipeline_job, run_to_end
from pipejob.core import spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKENS = {"import": "userpkg.brought:windows"}
CLASSES = {"import": "userpkg.brought:windows", "args": {"classes": 3}}
IMAGES: dict[str, Any] = {}  # the synthetic 32 x 32 images of numClasses classes

# name: (factory in userpkg/libraries.py, its args, data)
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "to-device": ("moved", {}, IMAGES),
    "peft-lora-llama": ("lora_llama", {}, TOKENS),
    "open-clip-text": ("open_clip_text", {"length": 16}, CLASSES),
    "x-transformers": ("x_transformers_decoder", {}, TOKENS),
    "vit-pytorch": ("vit_pytorch", {"size": 32}, IMAGES),
    "unet2d-condition": ("ConditionedUNet", {"size": 32, "pooled": True}, IMAGES),
    "scripted": ("Scripted", {"inputs": 3 * 32 * 32}, IMAGES),
}


def job(name: str, **fields: Any) -> dict[str, Any]:
    factory, args, data = MODELS[name]
    fields |= {
        "model": {"import": f"userpkg.libraries:{factory}", "args": args},
        "stages": 2,
        "microBatches": 2,
        "numClasses": 3,
    }
    return pipeline_job(f"library-{name}", **fields, **({"data": data} if data else {}))


@pytest.mark.parametrize("name", list(MODELS))
def test_a_library_model_trains_exactly_as_a_job(name: str, tmp_path: Path, monkeypatch):
    pytest.importorskip(
        {
            "peft-lora-llama": "peft",
            "open-clip-text": "open_clip",
            "x-transformers": "x_transformers",
            "vit-pytorch": "vit_pytorch",
            "unet2d-condition": "diffusers",
        }.get(name, "torch")
    )
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    got = check_gradients(spec.parse(job(name, steps=1)), tmp_path, timeout=400)
    assert len(got["stages"]) == 2 and all(got["stages"]), got["stages"]

    out = tmp_path / "model"
    code, said, summary = run_to_end(
        job(name, steps=2, output={"path": str(out)}), tmp_path, timeout=400
    )
    assert code == 0, said[-3000:]
    assert summary is not None and summary["steps"] == 2, summary
    factory, args, _ = MODELS[name]
    fresh = getattr(libraries, factory)(**args)
    fresh.load_state_dict(load_file(out / "model.safetensors"), strict=True)
