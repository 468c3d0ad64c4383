"""Entry point of every pod: `python -m pipejob.trainer`. Configured only by the env contract."""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

from pipejob.trainer import tuning
from pipejob.trainer.world import ContractError, Env, RendezvousError, log, read_env


def run(env: Env) -> dict | None:
    """Run this process's role; the master returns the run's summary."""
    if env.kind == "PipelineJob":
        from pipejob.trainer import pipeline

        return pipeline.run(env)
    if env.kind == "HybridJob":
        from pipejob.trainer import hybrid

        return hybrid.run(env)
    raise ContractError(f"unknown job kind {env.kind!r}")


def _quiet(showwarning):
    """torch forces its TorchScript-optimizer deprecation warning on (simplefilter "always"
    around the warn), so no filter can drop it; torch is pinned and users cannot act on it."""

    def show(message, category, *args, **kwargs):
        if "`TorchScript` support for functional optimizers" not in str(message):
            showwarning(message, category, *args, **kwargs)

    return show


def main() -> int:
    # gloo's deprecation chatter at shutdown says nothing useful to a user.
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
    warnings.showwarning = _quiet(warnings.showwarning)
    try:
        env = read_env()
        # Before torch loads: OpenMP and malloc read their settings once.
        settings = tuning.apply(
            tuning.for_process(env.kind, env.role, env.rank, env.world, env.gpus, os.environ)
        )
    except (ContractError, ValueError) as e:
        log(None, f"error: {e}")
        return 2
    log(env, f"performance settings: {settings.describe()}")
    try:
        summary = run(env)
    except RendezvousError as e:
        log(env, f"error: {e}")
        return 3
    except Exception:
        log(env, "error: training failed:\n" + traceback.format_exc())
        return 1
    if summary is not None and env.summary_file:
        with open(env.summary_file, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
