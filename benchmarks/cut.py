"""How pipejob cuts a model, measured against the alternatives, in one run:

  fx        pipejob's cut (trainer/workloads/cut.py): torch.fx traces the forward with the cut
            candidates as leaves; each stage is a GraphModule of the original modules
  pipelining  torch.distributed.pipelining's front end: `pipeline(model, mb_args, split_spec)`
            traces with torch.export; `get_stage_module(i)`
  layers    the layer list pipejob used before: the stage's modules in an nn.Sequential

For ResNet-50 (batch 8, 64x64) and pipejob's transformer (batch 8, 128 tokens) cut in 2 at
the same module: seconds to trace and cut, each stage-0 module's forward + backward (median of
--repeats), whether the stage module pickles (the master ships stages to their pods), and
whether a stage in eval mode leaves its buffers (BatchNorm's running statistics) alone, as
evaluation needs.
It measures; it asserts nothing.

    python benchmarks/cut.py
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline
from torchvision.models import get_model

from pipejob.core.workload import Transformer
from pipejob.trainer.workloads.cut import Traced
from pipejob.trainer.workloads.transformer import TransformerLM

warnings.filterwarnings("ignore")


def seconds(work: Callable[[], Any], repeats: int) -> float:
    work()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step(module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()

    return run


def pickles(module: nn.Module) -> str:
    try:
        pickle.dumps(module)
        return "yes"
    except Exception as e:
        return f"no ({type(e).__name__})"


def keeps_statistics(module: nn.Module, x: torch.Tensor) -> str:
    """Whether a forward in eval mode leaves the module's buffers (BatchNorm's running
    statistics) as they were."""
    before = {k: v.clone() for k, v in module.named_buffers()}
    if not before:
        return "no buffers"
    module.eval()
    with torch.no_grad():
        module(x)
    module.train()
    after = dict(module.named_buffers())
    kept = all(torch.equal(v, after[k]) for k, v in before.items())
    return "yes" if kept else "NO: eval changed its running statistics"


def compare(name: str, model: nn.Module, x: torch.Tensor, at: str, repeats: int) -> None:
    print(f"\n{name}, cut at {at}:")
    start = time.perf_counter()
    traced = Traced(model)
    fx_stage = traced.split([at])[0]
    fx_seconds = time.perf_counter() - start
    start = time.perf_counter()
    pipe = pipeline(model, mb_args=(x,), split_spec={at: SplitPoint.BEGINNING})
    pipe_stage = pipe.get_stage_module(0)
    pipe_seconds = time.perf_counter() - start
    units = traced.units[: traced.units.index(at)]
    layers = nn.Sequential(*(model.get_submodule(u) for u in units))
    rows = [
        ("fx", fx_seconds, fx_stage),
        ("pipelining", pipe_seconds, pipe_stage),
        ("layers", None, layers),
    ]
    print(
        f"  {'':<11} {'trace+cut s':>11} {'stage 0 fwd+bwd s':>18} {'pickles':>18}"
        "  eval leaves the buffers alone"
    )
    for label, cut_seconds, module in rows:
        took = seconds(step(module, x), repeats)
        cut_text = f"{cut_seconds:.3f}" if cut_seconds is not None else "-"
        print(
            f"  {label:<11} {cut_text:>11} {took:>18.4f} {pickles(module):>18}"
            f"  {keeps_statistics(module, x)}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    compare(
        "ResNet-50",
        get_model("resnet50", weights=None),
        torch.randn(8, 3, 64, 64),
        "layer3.0",
        args.repeats,
    )
    spec = Transformer(vocab_size=256, layers=4, width=128, heads=4, seq_len=128)
    compare(
        "transformer", TransformerLM(spec), torch.randint(256, (8, 128)), "blocks.2", args.repeats
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
