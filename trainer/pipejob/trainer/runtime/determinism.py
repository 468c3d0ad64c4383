"""spec.deterministic: torch's deterministic kernels in every process of the job, where exactness
costs speed (a GPU's). Without it a run on CPUs already repeats itself bit for bit: every sum a
step makes has a fixed order (docs/user-guide.md, "Same seed, same bits"). And every process's
own random streams, started from spec.seed (`seed_streams`)."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# cuBLAS keeps its reductions in a fixed order only with a workspace of its own per stream
# (CUDA's documentation: "Results reproducibility"); read when cuBLAS starts. A user's wins.
CUBLAS_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE = ":4096:8"


def apply(deterministic: bool, environ: MutableMapping[str, str] | None = None) -> bool:
    """With `deterministic`, make every kernel this process runs a deterministic one
    (torch.use_deterministic_algorithms: an op without one raises, naming itself). Before the
    process touches a GPU. Returns whether it did."""
    if not deterministic:
        return False
    environ = os.environ if environ is None else environ
    environ.setdefault(CUBLAS_VARIABLE, CUBLAS_WORKSPACE)
    import torch

    torch.use_deterministic_algorithms(True)
    return True


def seed_streams(seed: int, rank: int) -> None:
    """Start this process's own random streams from spec.seed and its rank: torch's, which
    a stage's dropout draws from, and Python's (a checkpoint keeps both). torch seeds a new
    process's generator at random, so two runs would draw other masks. What must leave them
    be (a model's build, the cut's measurement, an evaluation) forks them."""
    import random

    import torch

    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
