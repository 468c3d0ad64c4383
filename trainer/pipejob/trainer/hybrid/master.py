"""The HybridJob master: creates the table on the ps, starts every trainer's loop over RPC,
prints their progress and evaluations, completes checkpoints, writes the trained model
(spec.output, hybrid/output.py), and returns the run's summary."""

from __future__ import annotations

import builtins
import queue
import re
import threading
import time
from typing import Any

import torch
import torch.distributed.rpc as rpc

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.trainer.hybrid import output, trainer
from pipejob.trainer.hybrid.ps import Table, load_table, table_names, table_state, table_weight
from pipejob.trainer.hybrid.summary import render, summarize
from pipejob.trainer.runtime import checkpoint, master, memory, monitor, world
from pipejob.trainer.runtime.events import Events
from pipejob.trainer.runtime.world import Env

# ---- master ----


class Reports:
    """Prints one line per logged step once every trainer has reported it."""

    def __init__(self, env: Env, trainers: list[str], first: int = 0, samples: int = 0):
        self.env, self.trainers, self.first = env, trainers, first
        self.samples = samples  # of the data's stream, read before step `first`
        self.steps = env.spec.steps
        self.batch = env.spec.batch_size * env.spec.trainers.max  # a step's, at any count
        self.lock = threading.Lock()
        self.pending: dict[int, dict[str, float]] = {}
        self.created = time.perf_counter()
        self.last_step, self.last_time = first, self.created
        self.evaluation: dict[str, Any] | None = None  # the latest, with its step
        self.losses: dict[int, float] = {}  # the batch's loss at each logged step
        logging = env.spec.logging
        self.events = Events(logging.tensorboard if logging else None, first)

    def evaluated(self, step: int, figures: dict[str, Any]) -> None:
        """DDP rank 0 evaluated the model after `step` on held-out bags."""
        loss, accuracy, count = figures["loss"], figures["accuracy"], figures["bags"]
        with self.lock:
            self.evaluation = {"evalStep": step, "evalLoss": loss, "evalAccuracy": accuracy,
                               "evalBags": count}  # fmt: skip
        shown = "" if accuracy is None else f", accuracy {100 * accuracy:.1f}%"
        world.log(self.env, f"eval step {step}: loss {loss:.4f}{shown} on {count}"
                            " held-out bags")  # fmt: skip
        monitor.board().evaluated(step, loss, accuracy=accuracy)
        with self.lock:
            self.events.scalars(step, eval_loss=loss, eval_accuracy=accuracy)

    def report(self, trainer: str, step: int, loss: float) -> None:
        with self.lock:
            losses = self.pending.setdefault(step, {})
            losses[trainer] = loss
            if len(losses) < len(self.trainers):
                return
            del self.pending[step]
            now = time.perf_counter()
            if step == self.first:  # every trainer is set up and about to take a step
                world.log(self.env, f"trainers ready after {now - self.created:.1f}s of setup")
            elif step > self.last_step:
                samples = self.batch * (step - self.last_step)
                rate = samples / max(now - self.last_time, 1e-9)
                mean = sum(losses.values()) / len(losses)
                self.losses[step] = mean
                world.log(self.env, f"step {step}/{self.steps}  loss {mean:.4f}"
                                    f"  {rate:,.0f} samples/s")  # fmt: skip
                steps = step - self.last_step
                monitor.board().step(step, mean, (now - self.last_time) / steps,
                                     samples // steps)  # fmt: skip
                memory.refresh(self.env, monitor.board())  # each member's peak, not waited for
                self.events.scalars(step, loss=mean, samples_per_second=rate)
            else:
                return
            self.last_step, self.last_time = step, now


# The master's reports board, fed by the trainers over RPC.
_REPORTS: Reports | None = None


def report(trainer: str, step: int, loss: float) -> None:
    """Runs on the master: a trainer finished `step` with `loss`."""
    assert _REPORTS is not None, "progress report reached a process that is not the master"
    _REPORTS.report(trainer, step, loss)


def evaluated(step: int, figures: dict[str, Any]) -> None:
    """Runs on the master: DDP rank 0's evaluation after `step` (evaluate.evaluate)."""
    assert _REPORTS is not None, "evaluation reached a process that is not the master"
    _REPORTS.evaluated(step, figures)


def train(env: Env) -> dict[str, Any]:
    global _REPORTS
    spec: HybridSpec = env.spec
    emb = spec.embedding
    [ps], trainers = env.names("ps"), env.names("trainer")
    table = rpc.remote(ps, Table, args=(spec, trainers))
    found = checkpoint.latest_for(env)
    resume = None if found is None else _resume(env, found, table)
    first = 0 if resume is None else resume["step"]
    if first >= spec.steps:
        if spec.output is not None and found is not None:  # the model is in the checkpoint
            paths = output.export_checkpoint(found.directory, found.manifest, spec.output.path,
                                             spec.output.format)  # fmt: skip
            world.log(env, f"wrote the trained model to {spec.output.path}:"
                           f" {', '.join(p.name for p in paths)}")  # fmt: skip
        return master.nothing_left(env, first)
    before = rpc.rpc_sync(ps, table_weight, args=(table,))
    world.log(env, f"training {spec.steps} steps x {spec.batch_size} bags on"
                   f" {', '.join(trainers)}; EmbeddingBag {emb.num_embeddings}x{emb.dim}"
                   f" ({emb.mode}) on {ps}")  # fmt: skip
    _REPORTS = Reports(env, trainers, first, 0 if resume is None else resume["samples"])
    monitor.board().phase("training")
    # A training loop may run for hours: no RPC timeout (0) on it. A trainer that dies fails
    # its future when its connection breaks.
    futures = [rpc.rpc_async(t, trainer.train, args=(table, resume), timeout=0)
               for t in trainers]  # fmt: skip
    try:
        results = dict(zip(trainers, _wait_all(futures), strict=True))
    finally:
        _REPORTS.events.close()
    after = rpc.rpc_sync(ps, table_weight, args=(table,))
    summary = summarize(env, results, before, after, first, _REPORTS.evaluation)
    summary["losses"] = list(_REPORTS.losses.values())  # at each logged step
    for line in render(summary):
        world.log(env, line)
    if spec.output is not None:
        state = rpc.rpc_sync(ps, table_state, args=(table,))
        meta = {"kind": env.kind, "job": env.job, "model": output.model_spec(spec),
                "metrics": output.metrics(summary), "steps": spec.steps}  # fmt: skip
        paths = output.write(spec.output.path, spec.output.format, state,
                             results[trainers[0]]["dense"], meta)  # fmt: skip
        summary["output"] = [str(p) for p in paths]
        world.log(env, f"wrote the trained model to {spec.output.path}:"
                       f" {', '.join(p.name for p in paths)}")  # fmt: skip
    return summary


def _resume(env: Env, found: checkpoint.Checkpoint, table: rpc.RRef) -> dict[str, Any]:
    """Load the table (and its optimizers' states) on the ps and the master's RNG state;
    what the trainers need to resume: the dense layer's file and the data's position, which
    hold at any trainer count (every step reads one batch of trainers.max's size)."""
    checkpoint.fits(found, env)
    directory = str(found.directory)
    names = rpc.rpc_sync(table.owner(), table_names, args=(table,))
    entries = checkpoint.sources(found, checkpoint.index_of(found), names)
    rpc.rpc_sync(table.owner(), load_table, args=(table, directory, entries))
    own = found.load("master.pt")
    checkpoint.set_rng_state(own["rng"])
    batch = env.spec.batch_size * env.spec.trainers.max
    samples = own.get("data", {}).get("samples", found.step * batch)
    saved = found.manifest.get("trainerCount")
    count = len(env.names("trainer"))
    world.log(
        env,
        f"resumed from step {found.step} ({directory})"
        + (f", written by {saved} trainers" if saved not in (None, count) else ""),
    )
    monitor.board().resumed(found.step)
    return {"step": found.step, "directory": directory, "dense": found.entry("dense.pt"),
            "samples": samples}  # fmt: skip


def write_manifest(step: int, files: list[dict[str, Any]], seconds: float) -> None:
    """Runs on the master (called by DDP rank 0): complete the checkpoint of `step`."""
    env = world.current()
    root = env.spec.checkpoint.path
    start = time.perf_counter()
    assert _REPORTS is not None, "a checkpoint reached a process that is not the master"
    samples = _REPORTS.samples + (step - _REPORTS.first) * _REPORTS.batch  # the data's position
    own = checkpoint.save_part(
        checkpoint.step_dir(root, step),
        "master.pt",
        {"rng": checkpoint.rng_state(), "data": {"samples": samples}},
    )
    files = [own, *files]
    # The model's spec and latest evaluation travel along, for `pipejob export`.
    evaluation = _REPORTS.evaluation or {}
    checkpoint.write_manifest(root, step, files, kind=env.kind, job=env.job,
                              trainerCount=len(env.names("trainer")),
                              model=output.model_spec(env.spec),
                              metrics=output.metrics(evaluation))  # fmt: skip
    checkpoint.prune(root)
    seconds += time.perf_counter() - start
    master.checkpoint_written(env, step, files, seconds, checkpoint.step_dir(root, step))


def _wait_all(futures: list[torch.futures.Future]) -> list[Any]:
    """All results, but raise the first failure as soon as it arrives: the other trainers
    may be stuck in an allreduce waiting for the one that failed."""
    finished: queue.SimpleQueue[torch.futures.Future] = queue.SimpleQueue()
    for future in futures:
        future.add_done_callback(finished.put)
    for _ in futures:
        future = finished.get()
        try:
            future.wait()
        except Exception as e:
            original = _original(e)
            if original is e:
                raise
            raise original from e
    return [future.wait() for future in futures]


# How an rpc_async future reports a remote exception: a RuntimeError that names its type.
_REMOTE = re.compile(r"(\w+): On WorkerInfo\(id=\d+, name=([^)]+)\):")


def _original(error: Exception) -> Exception:
    """The remote exception as its own (builtin) type with its own message and the worker's
    name, as rpc_sync would raise it: so a permanent failure (an ImportError from
    spec.dense.import, a ValueError from the data) is told apart from a lost peer."""
    text = str(error)
    match = _REMOTE.match(text)
    kind = getattr(builtins, match[1], None) if match else None
    if match is None or not (isinstance(kind, type) and issubclass(kind, Exception)):
        return error
    said = [line for line in text.splitlines() if line.startswith(f"{match[1]}: ")]
    return kind(f"{match[2]}: {said[-1][len(match[1]) + 2 :]}")
