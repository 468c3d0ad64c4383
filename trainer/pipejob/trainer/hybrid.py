"""HybridJob roles: an EmbeddingBag on a parameter server, DDP dense layers on the trainers.

- master: creates the table on the ps (`rpc.remote`), starts every trainer's loop
  (`rpc_async`, passing the table's RRef), prints progress, and returns the run's summary.
- ps: holds the table and, for each trainer, the optimizer that steps the table with that
  trainer's gradients; answers lookups and backward passes over RPC.
- trainerK: forms the DDP group with the other trainers (its own port), then joins RPC and waits
  for the master's call. Its loop looks bags up over RPC, runs the DDP-replicated nn.Linear and
  backpropagates with distributed autograd; then it steps the dense layer with its local
  optimizer on the context's gradients. It reads only its own partition of the synthetic data
  (see `data`).

Two round trips per step, where the tutorial's design (a DistributedOptimizer over the table's
and the dense parameters) takes four: the lookup, the backward, and the optimizer's step as an
RPC to the ps and one to the trainer itself. Here the ps steps the table as the lookup's
gradient arrives, inside the backward (`Table.lookup`): when `dist_autograd.backward` returns,
the table is updated, exactly as after a DistributedOptimizer step (the same torch.optim class,
one per trainer, applied to the same gradient), and the next lookup sees it."""

from __future__ import annotations

import contextlib
import functools
import math
import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipejob.trainer import checkpoint, data, monitor, profiling, world
from pipejob.trainer.optim import optimizer_args
from pipejob.trainer.world import Env

# This process's env, for the trainer loop the master starts over RPC.
_ENV: Env | None = None
# The master's progress board, fed by the trainers' reports over RPC.
_PROGRESS: Progress | None = None


def run(env: Env) -> dict[str, Any] | None:
    global _ENV
    _ENV = env
    if env.role == "master":
        return _run_master(env)
    if env.role == "trainer":
        world.join_ddp(env)
        world.log(env, f"joined the DDP group as rank {env.ddp_rank}/{env.ddp_world_size}"
                       f" ({env.ddp_backend})")  # fmt: skip
        world.join_rpc(env)
        rpc.shutdown()  # serves the master's call to _train until the whole world is done
        dist.destroy_process_group()
        return None
    if env.role == "ps":
        world.join_rpc(env)
        rpc.shutdown()
        return None
    raise world.ContractError(f"HybridJob has no role {env.role!r}")


# ---- parameter server side (called over RPC) ----


class Table:
    """The ps's EmbeddingBag and one optimizer per trainer (its own momentum, ...), each
    applied to the table as that trainer's gradient for a lookup arrives."""

    def __init__(self, spec: dict[str, Any], trainers: list[str]):
        emb = spec["embedding"]
        self.module = nn.EmbeddingBag(emb["numEmbeddings"], emb["dim"], mode=emb["mode"])
        nn.init.normal_(self.module.weight, generator=torch.Generator().manual_seed(spec["seed"]))
        optimizer_class, kwargs = optimizer_args(spec["optimizer"])
        self.optimizers = {t: optimizer_class(self.module.parameters(), **kwargs)
                           for t in trainers}  # fmt: skip
        self.lock = threading.Lock()  # one update at a time; lookups read between them

    def lookup(self, trainer: str, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The bags, from a leaf that shares the table's weight: when the backward brings
        the leaf its gradient, the hook steps the trainer's optimizer with it, instead of
        the gradient waiting in the dist-autograd context for an optimizer RPC."""
        leaf = self.module.weight.detach().requires_grad_()
        leaf.register_hook(functools.partial(self.step, trainer))
        return F.embedding_bag(ids, leaf, offsets, mode=self.module.mode)

    def step(self, trainer: str, grad: torch.Tensor) -> None:
        weight = self.module.weight
        with self.lock:
            weight.grad = grad
            self.optimizers[trainer].step()
            weight.grad = None


def _lookup(table: rpc.RRef, trainer: str, ids: torch.Tensor,
            offsets: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return table.local_value().lookup(trainer, ids, offsets)


def _table_weight(table: rpc.RRef) -> torch.Tensor:
    return table.local_value().module.weight.detach().clone()


def _save_table(table: rpc.RRef, directory: str) -> dict[str, Any]:
    """The table and every trainer's optimizer state for it, saved by the ps itself."""
    t = table.local_value()
    with t.lock:
        return checkpoint.save_module(directory, "ps.pt", t.module, t.optimizers)


def _load_table(table: rpc.RRef, directory: str, entry: dict[str, Any]) -> None:
    t = table.local_value()
    checkpoint.load_module(directory, entry, t.module, t.optimizers)


# ---- master ----


class Progress:
    """Prints one line per logged step once every trainer has reported it."""

    def __init__(self, env: Env, trainers: list[str], first: int = 0):
        self.env, self.trainers, self.first = env, trainers, first
        self.steps, self.batch = env.spec["steps"], env.spec["batchSize"]
        self.lock = threading.Lock()
        self.pending: dict[int, dict[str, float]] = {}
        self.created = time.perf_counter()
        self.last_step, self.last_time = first, self.created

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
                samples = len(self.trainers) * self.batch * (step - self.last_step)
                rate = samples / max(now - self.last_time, 1e-9)
                mean = sum(losses.values()) / len(losses)
                world.log(self.env, f"step {step}/{self.steps}  loss {mean:.4f}"
                                    f"  {rate:,.0f} samples/s")  # fmt: skip
                steps = step - self.last_step
                monitor.board().step(step, mean, (now - self.last_time) / steps,
                                     samples // steps)  # fmt: skip
            else:
                return
            self.last_step, self.last_time = step, now


def _report(trainer: str, step: int, loss: float) -> None:
    assert _PROGRESS is not None, "progress report reached a process that is not the master"
    _PROGRESS.report(trainer, step, loss)


def _run_master(env: Env) -> dict[str, Any]:
    world.join_rpc(env)
    try:
        summary = _train_world(env)
    except BaseException:
        rpc.shutdown(graceful=False)
        raise
    rpc.shutdown()
    return summary


def _train_world(env: Env) -> dict[str, Any]:
    global _PROGRESS
    spec, emb = env.spec, env.spec["embedding"]
    [ps], trainers = env.names("ps"), env.names("trainer")
    table = rpc.remote(ps, Table, args=(spec, trainers))
    found = checkpoint.latest_for(env)
    resume = None if found is None else _resume(env, found, table)
    first = 0 if resume is None else resume["step"]
    if first >= spec["steps"]:
        world.log(env, f"the checkpoint of step {first} completes all {spec['steps']} steps:"
                       " nothing left to train")  # fmt: skip
        return {"kind": env.kind, "job": env.job, "steps": 0, "resumedFromStep": first}
    before = rpc.rpc_sync(ps, _table_weight, args=(table,))
    world.log(env, f"training {spec['steps']} steps x {spec['batchSize']} bags on"
                   f" {', '.join(trainers)}; EmbeddingBag {emb['numEmbeddings']}x{emb['dim']}"
                   f" ({emb['mode']}) on {ps}")  # fmt: skip
    _PROGRESS = Progress(env, trainers, first)
    monitor.board().phase("training")
    # A training loop may run for hours: no RPC timeout (0) on it. A trainer that dies fails
    # its future when its connection breaks.
    futures = [rpc.rpc_async(t, _train, args=(table, resume), timeout=0) for t in trainers]
    results = dict(zip(trainers, _wait_all(futures), strict=True))
    after = rpc.rpc_sync(ps, _table_weight, args=(table,))
    summary = summarize(env, results, before, after)
    summary["resumedFromStep"] = None if resume is None else first
    print_summary(env, summary)
    return summary


def _resume(env: Env, found: checkpoint.Checkpoint, table: rpc.RRef) -> dict[str, Any]:
    """Load the table (and its optimizers' states) on the ps and the master's RNG state;
    what the trainers need to resume."""
    checkpoint.fits(found, env, trainerCount=len(env.names("trainer")))
    directory = str(found.directory)
    rpc.rpc_sync(table.owner(), _load_table, args=(table, directory, found.entry("ps.pt")))
    checkpoint.set_rng_state(found.load("master.pt")["rng"])
    world.log(env, f"resumed from step {found.step} ({directory})")
    monitor.board().resumed(found.step)
    return {"step": found.step, "directory": directory, "dense": found.entry("dense.pt")}


def _write_manifest(step: int, files: list[dict[str, Any]], seconds: float) -> None:
    """Runs on the master (called by DDP rank 0): complete the checkpoint of `step`."""
    env = _ENV
    assert env is not None
    root = env.spec["checkpoint"]["path"]
    start = time.perf_counter()
    own = checkpoint.save_part(checkpoint.step_dir(root, step), "master.pt",
                               {"rng": checkpoint.rng_state()})  # fmt: skip
    files = [own, *files]
    checkpoint.write_manifest(root, step, files, kind=env.kind, job=env.job,
                              trainerCount=len(env.names("trainer")))  # fmt: skip
    checkpoint.prune(root)
    size = sum(f["bytes"] for f in files) / 1e6
    seconds += time.perf_counter() - start
    world.log(env, f"checkpoint of step {step}: {len(files)} files, {size:.1f} MB in"
                   f" {seconds:.2f}s ({checkpoint.step_dir(root, step)})")  # fmt: skip


def _wait_all(futures: list[torch.futures.Future]) -> list[Any]:
    """All results, but raise the first failure as soon as it arrives: the other trainers
    may be stuck in an allreduce waiting for the one that failed."""
    finished: queue.SimpleQueue[torch.futures.Future] = queue.SimpleQueue()
    for future in futures:
        future.add_done_callback(finished.put)
    for _ in futures:
        finished.get().wait()
    return [future.wait() for future in futures]


def summarize(env: Env, results: dict[str, dict[str, Any]], before: torch.Tensor,
              after: torch.Tensor) -> dict[str, Any]:  # fmt: skip
    """The run's summary as plain JSON-serialisable values."""
    names = list(results)
    first = results[names[0]]["dense"]
    dense_diff = max(
        (w - first[k]).abs().max().item() for r in results.values() for k, w in r["dense"].items()
    )
    read = [set(r["read"].tolist()) for r in results.values()]
    overlap = sum(len(s) for s in read) - len(set().union(*read))
    per_trainer = {
        name: {k: v for k, v in r.items() if k not in ("dense", "read")}
        for name, r in results.items()
    }
    seconds = max(r["seconds"] for r in results.values())
    samples = sum(r["steps"] * r["batch_size"] for r in results.values())
    return {
        "kind": env.kind,
        "job": env.job,
        "trainers": len(names),
        "steps": env.spec["steps"],
        "batch_size": env.spec["batchSize"],
        "seconds": seconds,
        "samples_per_second": samples / seconds,
        "loss_first": sum(r["loss_first"] for r in results.values()) / len(names),
        "loss_final": sum(r["loss_final"] for r in results.values()) / len(names),
        "dense_max_abs_diff": dense_diff,
        "embedding_norm_before": before.norm().item(),
        "embedding_change_norm": (after - before).norm().item(),
        "partition_overlap": overlap,
        "per_trainer": per_trainer,
    }


def print_summary(env: Env, s: dict[str, Any]) -> None:
    lines = [
        f"done: {s['steps']} steps x {s['batch_size']} bags on {s['trainers']} trainer(s)"
        f" in {s['seconds']:.2f}s, {s['samples_per_second']:,.0f} samples/s",
        f"loss {s['loss_first']:.4f} -> {s['loss_final']:.4f} (mean over trainers)",
        f"dense replicas: max |difference| across trainers {s['dense_max_abs_diff']:.3g}",
        f"parameter server embedding: changed by {s['embedding_change_norm']:.4g}"
        f" (norm of after - before; norm before {s['embedding_norm_before']:.4g})",
        f"data: samples read by more than one trainer: {s['partition_overlap']}",
        f"{'trainer':<10} {'ddp':>3} {'loss first -> final':>20} {'samples/s':>10}"
        f" {'partition':>9} {'read':>7} {'dense moved':>11}",
    ]
    for name, t in s["per_trainer"].items():
        lines.append(
            f"{name:<10} {t['ddp_rank']:>3} {t['loss_first']:>9.4f} -> {t['loss_final']:<7.4f}"
            f" {t['samples_per_second']:>10,.0f} {t['partition_size']:>9} {t['samples_read']:>7}"
            f" {t['dense_change_norm']:>11.4g}"
        )
    for line in lines:
        world.log(env, line)


# ---- trainer ----


class HybridModel(nn.Module):
    """Sparse part: the remote EmbeddingBag, looked up over RPC. Dense part: DDP nn.Linear."""

    def __init__(self, table: rpc.RRef, trainer: str, dense: nn.Module, device: torch.device):
        super().__init__()
        self.table, self.trainer, self.dense, self.device = table, trainer, dense, device

    def lookup(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.futures.Future:
        """The bags, over RPC; inside a dist-autograd context, so the backward reaches the ps."""
        return rpc.rpc_async(self.table.owner(), _lookup,
                             args=(self.table, self.trainer, ids, offsets))  # fmt: skip

    def forward(self, bags: torch.Tensor) -> torch.Tensor:
        return self.dense(bags.to(self.device))


class DenseStep:
    """The dense layer's optimizer step on a step's dist-autograd gradients, deferred until
    the next step's lookup is in flight (it needs no dense weights), so the two overlap."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.grads: dict[torch.Tensor, torch.Tensor] | None = None

    def defer(self, grads: dict[torch.Tensor, torch.Tensor]) -> None:
        self.grads = grads

    def flush(self) -> None:
        """Take the deferred step, if any: before the dense forward, a checkpoint, the end."""
        if self.grads is None:
            return
        for p in self.params:
            p.grad = self.grads.get(p)
        self.optimizer.step()
        self.grads = None


def _device(env: Env) -> torch.device:
    if env.gpus == 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"gpusPerTrainer is {env.gpus} but {env.rpc_name} sees no CUDA device")
    assert env.ddp_rank is not None
    return torch.device("cuda", env.ddp_rank % torch.cuda.device_count())


def _train(table: rpc.RRef, resume: dict[str, Any] | None = None) -> dict[str, Any]:
    """One trainer's whole loop; the master calls it over RPC and gets its results. With
    `resume` (see `_resume`) it continues after the checkpoint's step."""
    env = _ENV
    assert env is not None and env.ddp_rank is not None and env.ddp_world_size is not None
    spec, seed = env.spec, env.spec["seed"]
    device = _device(env)
    torch.manual_seed(seed)  # DDP broadcasts rank 0's dense weights; seeding makes runs repeat
    linear = nn.Linear(spec["embedding"]["dim"], spec["dense"]["outFeatures"]).to(device)
    restored = None
    if resume is not None:  # before DDP, which starts from rank 0's weights: the saved ones
        restored = checkpoint.load_part(resume["directory"], resume["dense"])
        linear.load_state_dict(restored["model"])
    dense = DistributedDataParallel(
        linear, device_ids=[device.index] if device.type == "cuda" else None
    )
    model = HybridModel(table, env.rpc_name, dense, device)
    initial = [p.detach().clone() for p in linear.parameters()]
    optimizer_class, kwargs = optimizer_args(spec["optimizer"])
    optimizer = optimizer_class(linear.parameters(), **kwargs)  # the ps steps the table
    if restored is not None:
        checkpoint.load_optimizer_state(optimizer, linear, restored["optimizers"]["dense"])
    dense_step = DenseStep(optimizer)
    ps = table.owner().name

    dataset = data.SyntheticBags(
        size=spec["datasetSize"],
        num_embeddings=spec["embedding"]["numEmbeddings"],
        classes=spec["dense"]["outFeatures"],
        bag_size=spec["bagSize"],
        seed=seed,
    )
    part = data.partitions(spec["datasetSize"], env.ddp_world_size, seed)[env.ddp_rank]
    batches = data.batches(dataset, part, spec["batchSize"])
    first = 0 if resume is None else resume["step"]
    for _ in range(first):  # the batches of the steps before the checkpoint
        next(batches)
    read: set[int] = set()

    steps, every = spec["steps"], spec["logEvery"]
    profile = profiling.settings(spec)
    servers = [ps, "master"] if env.ddp_rank == 0 else []  # profiled along with the trainers
    report = rpc.rpc_async("master", _report, args=(env.rpc_name, first, math.nan))
    loss_first = math.nan
    start = time.perf_counter()
    for step in range(first + 1, steps + 1):
        batch = next(batches)
        read.update(batch.sample_ids)
        with profiling.window(env, profile, step, servers, sync=dist.barrier) as rpc_calls:
            loss = _step(model, dense_step, batch, device, rpc_calls)
        if step == first + 1:
            loss_first = loss.item()
        if checkpoint.due(spec, step):
            dense_step.flush()
            _checkpoint(env, step, table, linear, optimizer)
        if step % every == 0 or step == steps:
            report.wait()  # at most one report in flight; surfaces a failed one
            report = rpc.rpc_async("master", _report, args=(env.rpc_name, step, loss.item()))
    dense_step.flush()
    seconds = time.perf_counter() - start
    report.wait()
    moved = [(p.detach() - q).flatten() for p, q in zip(linear.parameters(), initial, strict=True)]

    return {
        "ddp_rank": env.ddp_rank,
        "steps": steps - first,
        "batch_size": spec["batchSize"],
        "seconds": seconds,
        "samples_per_second": (steps - first) * spec["batchSize"] / seconds,
        "loss_first": loss_first,
        "loss_final": loss.item(),
        "dense_change_norm": torch.cat(moved).norm().item(),
        "partition_size": len(part),
        "samples_read": len(read),
        "read": torch.tensor(sorted(read)),
        "dense": {k: v.detach().cpu() for k, v in linear.state_dict().items()},
    }


def _checkpoint(env: Env, step: int, table: rpc.RRef, linear: nn.Module,
                optimizer: torch.optim.Optimizer) -> None:  # fmt: skip
    """Once every trainer has finished `step`: DDP rank 0 saves the dense layer (the same on
    every rank) with its optimizer state and has the ps save the table; the master writes
    the manifest. The others wait, so nobody changes the table while it is saved."""
    dist.barrier()
    if env.ddp_rank == 0:
        start = time.perf_counter()
        directory = str(checkpoint.step_dir(env.spec["checkpoint"]["path"], step))
        saving = rpc.rpc_async(table.owner(), _save_table, args=(table, directory))
        dense = checkpoint.save_module(directory, "dense.pt", linear,
                                       {"dense": optimizer})  # fmt: skip
        files = [saving.wait(), dense]
        rpc.rpc_sync("master", _write_manifest, args=(step, files, time.perf_counter() - start))
    dist.barrier()


def _step(model: HybridModel, dense_step: DenseStep, batch: data.Batch, device: torch.device,
          rpc_calls: profiling.RpcCalls = contextlib.nullcontext) -> torch.Tensor:  # fmt: skip
    """One step; `rpc_calls` wraps its RPCs (the lookup), not DDP's parts. The backward
    steps the table on the ps; the dense layer's step (on gradients DDP averaged across the
    trainers during the backward) is deferred to overlap the next lookup."""
    ids, offsets = torch.tensor(batch.ids), torch.tensor(batch.offsets)
    labels = torch.tensor(batch.labels, device=device)
    with dist_autograd.context() as context:
        with rpc_calls():  # open until the reply: it brings the remote ops' profile
            lookup = model.lookup(ids, offsets)
            dense_step.flush()  # the previous step's, while the lookup is in flight
            bags = lookup.wait()
        loss = F.cross_entropy(model(bags), labels)
        dist_autograd.backward(context, [loss])
        dense_step.defer(dist_autograd.get_gradients(context))
    return loss
