"""Entry point of every pod: `python -m pipejob.trainer`. Configured only by the env contract."""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

from pipejob.trainer import monitor, tuning
from pipejob.trainer.world import (
    ContractError,
    Env,
    PreflightError,
    RendezvousError,
    log,
    read_env,
    write_termination_message,
)


def run(env: Env) -> dict | None:
    """Check the world's network, then run this process's role; the master returns the
    run's summary."""
    from pipejob.trainer import preflight  # imports torch: only after tuning.apply

    board = monitor.board()
    board.phase("preflight")
    try:
        report = preflight.check(env)
    except PreflightError as e:
        board.preflight(False, str(e))
        raise
    if report is not None:
        board.preflight(True, report.summary)
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
        return fail(None, f"error: {e}", f"bad environment: {e}", 2)
    log(env, f"performance settings: {settings.describe()}")
    try:
        if env.rank == 0:  # early, so the operator sees the job even during rendezvous
            monitor.serve(env.spec["steps"], env.monitor_port)
        summary = run(env)
    except PreflightError as e:
        return fail(env, f"error: {e}", str(e), 4)
    except RendezvousError as e:
        return fail(env, f"error: {e}", str(e), 3)
    except Exception as e:
        reason = f"training failed: {type(e).__name__}: {e}"
        return fail(env, "error: training failed:\n" + traceback.format_exc(), reason, 1)
    monitor.board().phase("finished")
    if summary is not None and env.summary_file:
        with open(env.summary_file, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def fail(env: Env | None, output: str, reason: str, code: int) -> int:
    """Say why this process fails: in its log, in its termination message (the job's status
    shows it) and, on the master, in /progress."""
    log(env, output)
    write_termination_message(reason)
    monitor.board().phase("failed", reason)
    return code


if __name__ == "__main__":
    sys.exit(main())
