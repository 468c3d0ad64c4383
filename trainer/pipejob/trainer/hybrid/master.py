"""The HybridJob master: has every parameter server make its shards of the tables (and load
them from a checkpoint), starts every trainer's loop over RPC, prints their progress and
evaluations (board.py), writes the trained model (spec.output, model_writer.py), and returns the
run's summary."""

from __future__ import annotations

import builtins
import queue
import re
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.rpc as rpc

from pipejob.core.kinds import tables
from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.trainer.hybrid import board, model_writer, ps, trainer
from pipejob.trainer.hybrid.model_writer import HybridManifest, HybridModelInfo
from pipejob.trainer.hybrid.records import FileEntry, HybridSummary, Resume, TrainerResults
from pipejob.trainer.hybrid.replicated import FILE as REPLICATED
from pipejob.trainer.hybrid.run_summary import render, summarize
from pipejob.trainer.runtime import checkpoint, monitor, roles, world
from pipejob.trainer.runtime.world import Env


def train(env: Env[HybridSpec]) -> HybridSummary:
    """The run: the servers make (or load) the tables, the trainers train, and the summary
    returns, with the trained model written (spec.output)."""
    began = time.perf_counter()
    # Making a large table's rows takes a while: no RPC timeout (0) on it.
    trainers = len(env.names("trainer"))
    _wait_all(
        [rpc.rpc_async(s, ps.start, args=(trainers,), timeout=0) for s in ps.server_names(env)]
    )
    found = checkpoint.latest_for(env)
    resume = None if found is None else _resume(env, found)
    first = 0 if resume is None else resume.step
    if first >= env.spec.steps:
        return _nothing_left(env, found, first)
    _log_start(env, began)
    results, reports = _train_all(env, resume, first)
    summary = _summary(env, results, reports, first)
    if env.spec.output is not None:
        summary["output"] = [str(p) for p in _write_model(env, summary, results)]
    return summary


def _nothing_left(
    env: Env[HybridSpec], found: checkpoint.Checkpoint | None, first: int
) -> HybridSummary:
    """The summary of a run whose checkpoint holds every step, its model written from the
    checkpoint (spec.output)."""
    output = env.spec.output
    if output is not None and found is not None:  # the model is in the checkpoint
        manifest = cast(HybridManifest, found.manifest)  # as read (JSON)
        paths = model_writer.export_checkpoint(
            found.directory, manifest, output.path, output.format
        )
        _log_model_written(env, output.path, paths)
    return HybridSummary(**roles.nothing_left(env, first))


def _log_start(env: Env[HybridSpec], began: float) -> None:
    """The line that starts training: the steps, the trainers, each server's tables and the
    seconds since `began` that making them took."""
    spec = env.spec
    trainers = env.names("trainer")
    sizes = [
        tables.size(tables.server_bytes(p, spec.sparse_optimizer.name)) for p in spec.placement()
    ]
    hosts = [f" in {t}" if spec.servers_in_trainers else "" for t in ps.server_names(env)]
    held = (f"ps{i}{h} ({b})" for i, (h, b) in enumerate(zip(hosts, sizes, strict=True)))
    world.log(
        env,
        f"training {spec.steps} steps x {spec.batch_size} samples on"
        f" {', '.join(trainers)}; {len(spec.embeddings)} table(s) on {', '.join(held)},"
        f" made in {time.perf_counter() - began:.1f}s",
    )


def _train_all(
    env: Env[HybridSpec], resume: Resume | None, first: int
) -> tuple[dict[str, TrainerResults], board.Reports]:
    """Every trainer's results (trainer.train) by name, and the reports they sent meanwhile."""
    trainers = env.names("trainer")
    samples = 0 if resume is None else resume.samples
    reports = board.open_reports(env, trainers, first, samples)
    monitor.board().phase("training")
    # A training loop may run for hours: no RPC timeout (0) on it. A trainer that dies fails
    # its future when its connection breaks.
    futures = [rpc.rpc_async(t, trainer.train, args=(resume,), timeout=0) for t in trainers]
    try:
        results = dict(zip(trainers, _wait_all(futures), strict=True))
    finally:
        reports.events.close()
    return results, reports


def _summary(
    env: Env[HybridSpec],
    results: dict[str, TrainerResults],
    reports: board.Reports,
    first: int,
) -> HybridSummary:
    """The run's summary, with each server's figures and the loss at each logged step; its
    lines logged."""
    figures = _wait_all([rpc.rpc_async(s, ps.figures, timeout=0) for s in ps.server_names(env)])
    per_server = {f"ps{i}": f for i, f in enumerate(figures)}  # in a trainer's process too
    summary = summarize(env, results, per_server, first, reports.evaluation)
    summary["losses"] = list(reports.losses.values())  # at each logged step
    for line in render(summary):
        world.log(env, line)
    return summary


def _write_model(
    env: Env[HybridSpec], summary: HybridSummary, results: dict[str, TrainerResults]
) -> list[Path]:
    """The trained model's files (spec.output): the tables from the servers (and the
    replicated ones), the dense module from the first trainer."""
    spec = env.spec
    assert spec.output is not None
    meta = HybridModelInfo(
        kind=env.kind,
        job=env.job,
        model=model_writer.model_spec(spec),
        metrics=model_writer.metrics(summary),
        steps=spec.steps,
    )
    first = results[env.names("trainer")[0]]
    rows = model_writer.live_rows(ps.server_names(env), spec.placement(), first.replicated)
    paths = model_writer.write(
        meta["model"], spec.output.path, spec.output.format, rows, first.dense, meta
    )
    _log_model_written(env, spec.output.path, paths)
    return paths


def _log_model_written(env: Env[HybridSpec], directory: str, paths: list[Path]) -> None:
    world.log(env, f"wrote the trained model to {directory}: {', '.join(p.name for p in paths)}")


def _resume(env: Env, found: checkpoint.Checkpoint) -> Resume:
    """Load the tables (and their optimizer state) on every server, by table and row range
    whatever the servers that wrote them (ps.Server.load), and the master's RNG state; what
    the trainers need to resume: the dense model's file and the data's position, which hold
    at any trainer count (every step reads one batch of trainers.max's size)."""
    checkpoint.fits(found, env)
    if "parameterServers" not in found.manifest:
        raise checkpoint.CheckpointError(
            f"{found.directory} is a checkpoint of an older pipejob, whose parameter server"
            " saved one table whole: give this job another checkpoint.path"
        )
    directory = str(found.directory)
    manifest = cast(HybridManifest, found.manifest)  # as read (JSON)
    entries = model_writer.server_entries(manifest)
    _wait_all(
        [
            rpc.rpc_async(s, ps.load, args=(directory, entries), timeout=0)
            for s in ps.server_names(env)
        ]
    )
    own = found.load("master.pt")
    checkpoint.set_rng_state(own["rng"])
    batch = env.spec.batch_size * env.spec.trainers.max
    samples = own.get("data", {}).get("samples", found.step * batch)
    shape = {
        "trainer(s)": (manifest.get("trainerCount"), len(env.names("trainer"))),
        "parameter server(s)": (manifest["parameterServers"], len(ps.server_names(env))),
    }
    other = [f"{saved} {what}" for what, (saved, now) in shape.items() if saved not in (None, now)]
    world.log(
        env,
        f"resumed from step {found.step} ({directory})"
        + (f", written by {' and '.join(other)}" if other else ""),
    )
    monitor.board().resumed(found.step)
    return Resume(
        step=found.step,
        directory=directory,
        dense=cast(FileEntry, found.entry("dense.pt")),
        replicated=next((e for e in manifest["files"] if e["name"] == REPLICATED), None),
        samples=samples,
    )


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
            original = _remote_exception(e)
            if original is e:
                raise
            raise original from e
    return [future.wait() for future in futures]


# How an rpc_async future reports a remote exception: a RuntimeError that names its type.
_REMOTE = re.compile(r"(\w+): On WorkerInfo\(id=\d+, name=([^)]+)\):")


def _remote_exception(error: Exception) -> Exception:
    """The remote exception as its own (builtin) type with its own message and the worker's
    name, as rpc_sync would raise it: so a permanent failure (an ImportError from
    spec.dense.import, a ValueError from the data) is told apart from a lost peer."""
    text = str(error)
    match = _REMOTE.match(text)
    kind = getattr(builtins, match[1], None) if match else None
    if match is None or not (isinstance(kind, type) and issubclass(kind, Exception)):
        return error
    lines = [line for line in text.splitlines() if line.startswith(f"{match[1]}: ")]
    return kind(f"{match[2]}: {lines[-1][len(match[1]) + 2 :]}")
