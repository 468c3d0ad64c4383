"""Entry point of every pod: `python -m pipejob.trainer`. Configured only by the env contract."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
import warnings
from typing import TYPE_CHECKING

from pipejob.core.contract import BROKEN_PREFIX, ExitCode, permanent_message
from pipejob.trainer.runtime import monitor, tuning, watchdog
from pipejob.trainer.runtime.failures import lost_peer, one_line, permanent_reason

if TYPE_CHECKING:
    from pipejob.trainer.runtime.roles import SummaryBase
from pipejob.trainer.runtime.world import (
    ContractError,
    Env,
    PreflightError,
    RendezvousError,
    listen_address,
    log,
    read_env,
    write_termination_message,
)


def run(env: Env) -> SummaryBase | None:
    """Check the world's network, then run this process's role; the master returns the
    run's summary. A master started alone (MASTER_FIRST) first checks what it can by itself."""
    began = time.monotonic()
    from pipejob.trainer.runtime import determinism, preflight  # torch: after tuning.apply

    if determinism.apply(env.spec.deterministic):
        log(env, "deterministic: torch's deterministic kernels only (spec.deterministic)")
    determinism.seed_streams(env.spec.seed, env.rank)
    # From here on, in every phase: loading torch's libraries holds the GIL for seconds, so
    # the heartbeats start after it (a member frozen before meets the rendezvous' deadline).
    watchdog.start(env, monitor.board() if env.rank == 0 else None)
    trainer = importlib.import_module(env.definition.trainer)
    checked, late = None, 0.0
    if env.rank == 0 and env.master_first and env.definition.checks_first:
        checked = trainer.check(env)  # in phase `starting`: the others start when it leaves it
        late = env.others_after(time.monotonic() - began)  # they start after its check
    board = monitor.board()
    board.phase("preflight")
    try:
        report = preflight.check(env, late)
    except PreflightError as e:
        board.preflight(False, str(e))
        raise
    if report is not None:
        board.preflight(True, report.summary)
    return trainer.run(env, checked)


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
    # TensorPipe warns once per broken pipe when a peer leaves (EOF, ECONNRESET, EPIPE): a
    # failing world would bury its one-line cause under them. A user's setting wins.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        tuning.preload_malloc()  # first: where it must, the process starts over with it
        env = read_env()
        # Before torch loads: OpenMP and malloc read their settings once.
        settings = tuning.apply(
            tuning.for_process(env.kind, env.role, env.rank, env.roles, env.gpus, os.environ)
        )
    except (ContractError, ValueError) as e:  # the same env would fail the same way: permanent
        reason = permanent_message("BadEnvironment", f"bad environment: {e}")
        return fail(None, f"error: {e}", reason, ExitCode.BAD_ENVIRONMENT)
    log(env, f"performance settings: {settings.describe()}")
    try:
        if env.rank == 0:  # early, so the operator sees the job even during rendezvous
            monitor.serve(env.spec.steps, env.monitor_port, listen_address(env.master_addr))
        summary = run(env)
    except PreflightError as e:
        return fail(env, f"error: {e}", str(e), ExitCode.PREFLIGHT_FAILED)
    except RendezvousError as e:
        return fail(env, f"error: {e}", str(e), ExitCode.RENDEZVOUS_FAILED)
    except Exception as e:
        permanent = permanent_reason(e)
        if permanent is not None:  # a restart would only repeat it: said in one line
            reason = permanent_message(permanent, f"training failed: {one_line(e)}")
            return fail(env, None, reason, ExitCode.PERMANENT)
        if lost_peer(e):  # the world broke: the member that failed first says why
            reason = f"{BROKEN_PREFIX} {one_line(e)}; another member failed or stopped first"
            return fail(env, f"error: {reason}", reason, ExitCode.TRAINING_FAILED)
        reason = f"training failed: {type(e).__name__}: {e}"
        trace = (
            "error: training failed with an unexpected error (a bug: please report it"
            " with this traceback):\n" + traceback.format_exc()
        )
        return fail(env, trace, reason, ExitCode.TRAINING_FAILED)
    monitor.board().phase("finished")
    if env.rank == 0:  # the final report, for an operator whose last poll came before the end
        final = {k: v for k, v in monitor.board().progress().to_json().items() if k != "preflight"}
        if len(json.dumps(final)) > 3900:  # a big world's peaks: the message keeps 4000 bytes
            final.pop("memory")
        write_termination_message(json.dumps(final))
    if summary is not None and env.summary_file:
        with open(env.summary_file, "w") as f:
            json.dump(summary, f, indent=2)
    return ExitCode.SUCCEEDED


def fail(env: Env | None, output: str | None, reason: str, code: ExitCode) -> int:
    """Say why this process fails: in its log, in its termination message (the job's status
    shows it) and, on the master, in /progress."""
    if output is not None:
        log(env, output)
    if code == ExitCode.PERMANENT or code == ExitCode.BAD_ENVIRONMENT:
        log(env, reason)  # last, so a log tail used as the termination message still says it
    write_termination_message(reason)
    monitor.board().phase("failed", reason)
    return code


if __name__ == "__main__":
    sys.exit(main())
