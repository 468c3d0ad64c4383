"""A HybridJob trainer's loop, which the master calls over RPC (`train`; hybrid/__init__.py
has the trainer join the DDP group and RPC first): its set-up, its steps, its results. A step
makes one call to each parameter server at once (`Tables`), which also carries the dense
model's gradients to be averaged (dense_step.py). How and why: docs/architecture.md, "A
HybridJob's step"."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.trainer import workloads
from pipejob.trainer.hybrid import board, evaluate, ps
from pipejob.trainer.hybrid.dense_step import DenseStep, broadcast_weights, kept_buffers
from pipejob.trainer.hybrid.records import Resume, TrainerFigures, TrainerResults
from pipejob.trainer.hybrid.replicated import Replicated
from pipejob.trainer.hybrid.router import Routed, Router
from pipejob.trainer.runtime import checkpoint, nonfinite, optim, profiling, world
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads import samples
from pipejob.trainer.workloads.samples import Batch

SEEN = 1 << 18  # samples whose (epoch, sample) a trainer keeps, to count repeats: ~30 MB


class Tables:
    """The trainer's side of the parameter servers: one call to each per step, and the
    gradients of the last lookup, held until the next call takes them, with a piece of the
    dense model's gradients for each server to average (`averaged`: what came back)."""

    def __init__(self, env: Env, router: Router):
        self.name, self.router = env.rpc_name, router
        names = ps.server_names(env)
        self.servers = [names[i] for i in router.servers]
        self.pending: list[torch.Tensor | None] = [None] * len(self.servers)
        self.dense: list[torch.Tensor | None] = [None] * len(self.servers)
        self.routed: Routed | None = None  # the last call's batch, routed
        self.replies: list[torch.Tensor] = []
        self.averaged: torch.Tensor | None = None  # the dense gradients the servers averaged

    def call(self, batch: Batch | None) -> list[torch.futures.Future]:
        """The step's calls, one to each server at once: the pending gradients and, unless
        `batch` is None (a flush), the batch's lookups."""
        if batch is None:
            requests = [(None, None)] * len(self.servers)
        else:
            self.routed = self.router.route(batch)
            requests = self.routed.requests
        calls = list(zip(self.servers, self.pending, requests, self.dense, strict=True))
        futures: list[torch.futures.Future | None] = [None] * len(calls)
        # The calls over RPC leave first; a call to this process's own server runs here.
        for k in sorted(range(len(calls)), key=lambda k: self.servers[k] == self.name):
            server, grads, (ids, lengths), dense = calls[k]
            futures[k] = self._exchange(server, grads, ids, lengths, dense)
        self.pending = [None] * len(self.servers)
        self.dense = [None] * len(self.servers)
        return [f for f in futures if f is not None]

    def _exchange(self, server: str, *args: torch.Tensor | None) -> torch.futures.Future:
        """One server's call: over RPC, or, to the server this process runs
        (spec.serversInTrainers), a direct call (its pooled embeddings, fresh and without a
        graph, are the reply's as RPC would copy them)."""
        if server != self.name:
            return rpc.rpc_async(server, ps.exchange, args=(self.name, *args))
        return ps.hosted().exchange(self.name, *args)

    def pooled(self, futures: list[torch.futures.Future], batch: Batch) -> dict[str, torch.Tensor]:
        """The tables' pooled embeddings of `batch` (the last called) from the replies, whose
        gradients the backward fills in."""
        assert self.routed is not None, "pooled before a call with a batch"
        replies = self._replies(futures)
        self.replies = [r.requires_grad_() for r in replies]
        return self.router.pool(self.replies, self.routed, batch)

    def _replies(self, futures: list[torch.futures.Future]) -> list[torch.Tensor]:
        """The replies' pooled embeddings; their pieces of the averaged dense gradients, if
        any, joined into `averaged`."""
        got = [f.wait() for f in futures]
        pieces = [mean for _, mean in got if mean is not None]
        self.averaged = torch.cat(pieces) if pieces else None
        return [pooled for pooled, _ in got]

    def take_averaged(self) -> torch.Tensor | None:
        """The averaged dense gradients the last replies brought, once (None: none came)."""
        averaged, self.averaged = self.averaged, None
        return averaged

    def backward_done(self, dense: torch.Tensor | None) -> None:
        """The backward has run: the replies' gradients go with the next call (zeros for a
        table the dense model left unused: every server waits for every trainer's), and
        `dense` (the dense model's gradients, flat), if given, a piece to each server."""
        self.pending = [torch.zeros_like(r) if r.grad is None else r.grad for r in self.replies]
        self.replies = []
        if dense is not None:
            self.dense = list(torch.tensor_split(dense.cpu(), len(self.servers)))

    def flush(self) -> None:
        """Send the pending gradients alone, so the servers step (before an evaluation, a
        checkpoint, the end)."""
        if any(g is not None for g in self.pending):
            self._replies(self.call(None))


def _device(env: Env) -> torch.device:
    if env.gpus == 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"gpusPerTrainer is {env.gpus} but {env.rpc_name} sees no CUDA device")
    assert env.ddp_rank is not None
    return torch.device("cuda", env.ddp_rank % torch.cuda.device_count())


@dataclass
class Trainer:
    """What a trainer's loop works with, made once before its first step (`_set_up`)."""

    env: Env[HybridSpec]
    device: torch.device
    dataset: samples.Samples
    loss_fn: workloads.Loss
    module: nn.Module  # the dense model
    buffers: list[torch.Tensor]  # its buffers rank 0 broadcasts before each forward
    initial: list[torch.Tensor]  # the module's parameters before the first step
    optimizer: torch.optim.Optimizer
    dense_step: DenseStep
    router: Router
    tables: Tables
    replicated: Replicated  # the tables every trainer holds (placement: replicated)
    batch: int  # the samples a step reads, over all the trainers
    batches: Iterator[Batch]  # this trainer's shares of them, from where the run resumes
    held_out: list[Batch] | None


@dataclass
class Trained:
    """What the loop leaves for the results (`_results`)."""

    share: int  # the last step's samples on this trainer
    first_loss: float
    loss: torch.Tensor  # the last step's
    seen: torch.Tensor  # (epoch, sample) rows, sorted, once each: of the first SEEN samples read
    seconds: float


def train(resume: Resume | None = None) -> TrainerResults:
    """One trainer's whole loop; the master calls it over RPC and gets its results. With
    `resume` (see master._resume) it continues after the checkpoint's step."""
    env: Env[HybridSpec] = world.current()
    first = 0 if resume is None else resume.step
    trainer = _set_up(env, resume)
    return _results(trainer, first, _loop(trainer, first))


def _set_up(env: Env[HybridSpec], resume: Resume | None) -> Trainer:
    """The dense model, the tables' side, and the data from the run's position (the dense
    module checked to fit it first)."""
    assert env.ddp_rank is not None and env.ddp_world_size is not None
    spec = env.spec
    device = _device(env)
    dataset, loss_fn = workloads.hybrid_data(spec), workloads.loss(spec)
    module, optimizer = _dense_model(spec, dataset, device, resume)
    router = Router(spec)
    # Every step reads one batch of batchSize x trainers.max (at any trainer count), each
    # trainer its share, from where the checkpoint's world stopped (samples consumed).
    batch, share = spec.batch_size * spec.trainers.max, (env.ddp_rank, env.ddp_world_size)
    read = functools.partial(
        samples.stream, dataset, batch, share, spec.seed, router.features, spec.recommends
    )
    evaluate.check_dense(spec, module, loss_fn, next(read(0)), device)
    return Trainer(
        env=env,
        device=device,
        dataset=dataset,
        loss_fn=loss_fn,
        module=module,
        buffers=kept_buffers(module),
        initial=[p.detach().clone() for p in module.parameters()],
        optimizer=optimizer,
        dense_step=DenseStep(module, optimizer),
        router=router,
        tables=Tables(env, router),
        replicated=Replicated(spec, device, resume),
        batch=batch,
        batches=read(0 if resume is None else resume.samples),
        held_out=_held_out_batches(env, spec, router),
    )


def _dense_model(
    spec: HybridSpec, dataset: samples.Samples, device: torch.device, resume: Resume | None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The dense module (restored from the checkpoint with `resume`), at DDP rank 0's
    weights on every trainer, and its optimizer (the servers step the tables)."""
    torch.manual_seed(spec.seed)  # every rank makes the same weights: runs repeat
    module = workloads.hybrid_dense(spec, len(samples.first(dataset)[0])).to(device)
    restored = None
    if resume is not None:
        restored = checkpoint.load_part(resume.directory, resume.dense)
        module.load_state_dict(restored["model"])
    broadcast_weights(module)  # rank 0's, as DDP would
    optimizer = optim.build(spec.optimizer, module.named_parameters())
    if restored is not None:
        checkpoint.load_optimizer_state(optimizer, module, restored["optimizers"]["dense"])
    return module, optimizer


def _loop(t: Trainer, first: int) -> Trained:
    """The steps after `first`, reported to the master every spec.logEvery steps and at the
    last; at the end, the tables and the dense model stepped to the last step's."""
    env, spec = t.env, t.env.spec
    assert env.ddp_world_size is not None
    profile = profiling.settings(spec)
    servers = [*t.tables.servers, "master"] if env.ddp_rank == 0 else []  # profiled alongside
    report = rpc.rpc_async("master", board.report, args=(env.rpc_name, first, math.nan))
    read: list[tuple[list[int], list[int]]] = []  # the first SEEN samples': a set at the end
    kept = 0
    first_loss = math.nan
    start = time.perf_counter()
    for step in range(first + 1, spec.steps + 1):
        drawn = next(t.batches)
        if kept < SEEN:
            read.append((drawn.epochs, drawn.sample_ids))
            kept += len(drawn.sample_ids)
        # The step is the same at any trainer count: each trainer's loss is weighted by its
        # share of the batch times the trainers (1 for equal shares), so the servers' and
        # DDP's averages of the trainers' gradients are the whole batch's mean gradient, and
        # the trainers' mean loss is the batch's.
        weight = len(drawn.sample_ids) * env.ddp_world_size / t.batch
        with profiling.window(env, profile, step, servers, sync=dist.barrier) as rpc_calls:
            loss = _step(t, drawn, weight, rpc_calls, step)
        if step == first + 1:
            first_loss = loss.item()
        if evaluate.due(spec, step):  # first: the step's checkpoint keeps its evaluation
            _evaluate(t, step)
        if checkpoint.due(spec, step):
            _checkpoint(t, step)
        if step % spec.log_every == 0 or step == spec.steps:
            report.wait()  # at most one report in flight; surfaces a failed one
            report = rpc.rpc_async("master", board.report, args=(env.rpc_name, step, loss.item()))
    _flush(t)
    seconds = time.perf_counter() - start
    report.wait()
    return Trained(len(drawn.sample_ids), first_loss, loss, _once_each(read), seconds)


def _once_each(read: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """The (epoch, sample) pairs of the batches `read`, sorted, each once."""
    if not read:
        return torch.empty(0, 2, dtype=torch.int64)
    epochs = torch.tensor([e for batch, _ in read for e in batch], dtype=torch.int64)
    ids = torch.tensor([i for _, batch in read for i in batch], dtype=torch.int64)
    span = int(ids.max()) + 1  # one number a pair, in the pairs' order: unique sorts it once
    keys = torch.unique(epochs * span + ids)
    return torch.stack([keys // span, keys % span], dim=1)


def _results(t: Trainer, first: int, trained: Trained) -> TrainerResults:
    """The trainer's results, for the master's summary (run_summary.py)."""
    spec, steps = t.env.spec, t.env.spec.steps
    params = zip(t.module.parameters(), t.initial, strict=True)
    moved = [(p.detach() - q).flatten() for p, q in params]
    assert t.env.ddp_rank is not None
    figures = TrainerFigures(
        ddpRank=t.env.ddp_rank,
        steps=steps - first,
        batchSize=spec.batch_size,
        seconds=trained.seconds,
        samplesPerSecond=(steps - first) * trained.share / trained.seconds,
        firstLoss=trained.first_loss,
        finalLoss=trained.loss.item(),
        denseChangeNorm=torch.cat(moved).norm().item(),
        share=trained.share,
        samplesRead=len(torch.unique(trained.seen[:, 1])),
        # Click logs: the most bytes of lines the reader held at once (its shuffle windows).
        readerPeakBytes=getattr(t.dataset, "most_held", None),
    )
    return TrainerResults(
        figures=figures,
        read=trained.seen,
        dense={k: v.detach().cpu() for k, v in t.module.state_dict().items()},
        replicated=t.replicated.state(),
    )


def _held_out_batches(env: Env, spec: HybridSpec, router: Router) -> list[Batch] | None:
    """DDP rank 0's held-out batches when spec.eval asks for them (it alone evaluates)."""
    if spec.eval is None or env.ddp_rank != 0:
        return None
    data = workloads.hybrid_held_out(spec)
    if data is None:
        world.log(
            env,
            "spec.eval: the data has no held-out split (spec.data's val, or"
            " spec.data.import's split='val'): not evaluating",
        )
        return None
    return samples.in_order(
        data, spec.batch_size, router.features, spec.recommends, spec.eval.batches
    )


def _flush(t: Trainer) -> None:
    """The servers and the dense optimizer take their pending steps (before an evaluation, a
    checkpoint, the end)."""
    t.tables.flush()
    t.dense_step.defer(t.tables.take_averaged())
    t.dense_step.flush()


def _evaluate(t: Trainer, step: int) -> None:
    """DDP rank 0 evaluates after `step` and tells the master; the others wait, so the
    tables stay as they were after `step`."""
    _flush(t)
    dist.barrier()
    if t.held_out is not None:
        figures = evaluate.evaluate(
            t.env.spec, t.router, t.tables.servers, t.replicated, t.module, t.held_out, t.loss_fn
        )
        rpc.rpc_sync("master", board.evaluated, args=(step, figures))
    dist.barrier()


def _checkpoint(t: Trainer, step: int) -> None:
    """Once every trainer has finished `step`: DDP rank 0 saves the dense model (the same on
    every rank) with its optimizer state and has every server save its shards of the tables;
    the master writes the manifest. The others wait, so nobody changes a table while it is
    saved."""
    _flush(t)
    dist.barrier()
    if t.env.ddp_rank == 0:
        begun = time.perf_counter()
        directory = str(checkpoint.step_dir(t.env.spec.checkpoint.path, step))
        saving = [rpc.rpc_async(s, ps.save, args=(directory,)) for s in t.tables.servers]
        dense = checkpoint.save_module(directory, "dense.pt", t.module, {"dense": t.optimizer})
        files = [*(f.wait() for f in saving), dense, *t.replicated.save(directory)]
        rpc.rpc_sync(
            "master", board.write_manifest, args=(step, files, time.perf_counter() - begun)
        )
    dist.barrier()


def _step(
    t: Trainer,
    batch: Batch,
    weight: float,
    rpc_calls: profiling.RpcCalls = contextlib.nullcontext,
    step: int = 0,
) -> torch.Tensor:
    """One step; `rpc_calls` wraps its calls to the servers. The backward is of the loss
    times `weight` (the trainer's share, `_loop`). The dense model's gradients are averaged
    over the trainers by the crossing the step makes anyway: the replicated tables' all-reduce
    if there are any, else the servers, in the next step's calls (their replies bring the
    average); the dense step on them comes before the next dense forward. Returns the loss
    times `weight`. A loss that is not finite stops the job before its backward changes
    anything (runtime/nonfinite.py)."""
    with rpc_calls():  # open until the replies: they bring the remote ops' profile
        pooled = t.tables.pooled(t.tables.call(batch), batch)
    t.dense_step.defer(t.tables.take_averaged())
    t.dense_step.flush()
    for buffer in t.buffers:  # as DDP does before a forward
        dist.broadcast(buffer, 0)
    pooled |= t.replicated.pooled(batch)
    out = evaluate.forward(t.env.spec, t.module, batch, pooled, t.device)
    loss = t.loss_fn(out, batch.labels.to(t.device))
    if not nonfinite.finite(loss):
        raise nonfinite.NonFiniteError(
            f"step {step}: the loss is {loss.item()} on {t.tables.name}; its update was not applied"
        )
    loss = loss * weight if weight != 1.0 else loss
    loss.backward()
    dense = t.dense_step.gradients()
    if t.replicated.optimizer is not None:  # an all-reduce anyway: the dense gradients join it
        t.dense_step.defer(t.replicated.step(t.env.ddp_world_size or 1, dense))
        t.tables.backward_done(None)
    else:
        t.tables.backward_done(dense)
    return loss
