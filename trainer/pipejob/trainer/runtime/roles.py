"""What every kind's master does around its training, and every other role around its
serving: join the RPC world, run, and leave it together (or not at all, after a failure).
Also the lines and summary fields both kinds' masters share."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, TypeVar, Unpack

from pipejob.trainer.runtime import monitor, rendezvous, world
from pipejob.trainer.runtime.world import Env

if TYPE_CHECKING:  # checkpoint imports torch: only once a role runs
    from pipejob.trainer.runtime.checkpoint_format import FileEntry, ManifestFields


class SummaryBase(TypedDict):
    """The summary fields every kind's run has (JSON, camelCase), before the kind's own
    (pipeline/summary.py, pipeline/eager/run.py, hybrid/run_summary.py)."""

    kind: str
    job: str
    steps: int
    resumedFromStep: int | None  # the step the run resumed from; None for a fresh one


S = TypeVar("S", bound=SummaryBase)  # a kind's own summary

# torch logs the traceback of a failed shutdown barrier (a peer gone) and then raises it: the
# raise is enough, said in one line by __main__. This logger logs nothing else.
logging.getLogger("torch.distributed.rpc.api").disabled = True


def drive(env: Env, train: Callable[[Env], S]) -> S:
    """The master's life: join the RPC world, train, then shut the world down; a failed
    world cannot finish together, so after a failure it leaves at once."""
    import torch.distributed.rpc as rpc

    from pipejob.trainer.workloads import imports

    imports.preload(env.spec)  # whole before any call's arguments are unpickled here
    rendezvous.join_rpc(env)
    try:
        result = train(env)
    except BaseException:
        rpc.shutdown(graceful=False)
        raise
    rpc.shutdown()
    return result


def serve(
    env: Env, device_maps: dict[str, dict[int, int]] | None = None, devices: list[int] | None = None
) -> None:
    """Any other role's life: join the RPC world and serve the master's calls until it is
    done (rpc.shutdown waits for the whole world)."""
    import torch.distributed.rpc as rpc

    from pipejob.trainer.workloads import imports

    imports.preload(env.spec)  # whole before any call's arguments are unpickled here
    rendezvous.join_rpc(env, device_maps, devices)
    rpc.shutdown()


def summary(env: Env, steps: int, first: int, **figures: object) -> SummaryBase:
    """A run's summary: the fields every kind has, then the kind's own (camelCase, as JSON).
    `first` is the step the run resumed from (0 for a fresh one)."""
    common = SummaryBase(kind=env.kind, job=env.job, steps=steps, resumedFromStep=first or None)
    return {**common, **figures}  # the kind's own fields after the common ones


def nothing_left(env: Env, first: int) -> SummaryBase:
    """A resumed run whose checkpoint already holds every step."""
    world.log(
        env,
        f"the checkpoint of step {first} completes all {env.spec.steps} steps:"
        " nothing left to train",
    )
    return summary(env, 0, first)


def complete_checkpoint(
    env: Env,
    step: int,
    files: list[FileEntry],
    seconds: float,
    **fields: Unpack[ManifestFields],
) -> None:
    """The master's end of a checkpoint of `step` whose `files` took `seconds` so far: its
    manifest (the fields every kind's has, then the kind's own), the older steps pruned, and
    its line."""
    from pipejob.trainer.runtime import checkpoint  # imports torch: only once a role runs

    root = env.spec.checkpoint.path
    start = time.perf_counter()
    directory = checkpoint.write_manifest(root, step, files, kind=env.kind, job=env.job, **fields)
    checkpoint.prune(root)
    checkpoint_written(env, step, files, seconds + time.perf_counter() - start, directory)


def checkpoint_written(
    env: Env, step: int, files: list[FileEntry], seconds: float, directory: str | Path
) -> None:
    """The line that says the checkpoint of `step` is complete, and the board's note of it."""
    size = sum(f["bytes"] for f in files) / 1e6
    world.log(
        env,
        f"checkpoint of step {step}: {len(files)} files, {size:.1f} MB in"
        f" {seconds:.2f}s ({directory})",
    )
    monitor.board().checkpointed(step)
