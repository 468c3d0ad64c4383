"""HybridJob roles: an EmbeddingBag on a parameter server, DDP dense layers on the trainers.

- master: creates the table on the ps (`rpc.remote`), starts every trainer's loop
  (`rpc_async`, passing the table's RRef), prints progress, and returns the run's summary.
- ps: holds the table and answers lookups, backward passes and optimizer steps over RPC.
- trainerK: forms the DDP group with the other trainers (its own port), then joins RPC and waits
  for the master's call. Its loop looks bags up over RPC, runs the DDP-replicated nn.Linear,
  backpropagates with distributed autograd and steps every parameter (the remote table's and
  the local dense ones) with one DistributedOptimizer. It reads only its own partition of the
  synthetic data (see `data`)."""

from __future__ import annotations

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
from torch.distributed.optim import DistributedOptimizer
from torch.nn.parallel import DistributedDataParallel

from pipejob.trainer import data, world
from pipejob.trainer.world import Env

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
}

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


def optimizer_args(spec: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, float]]:
    """The torch optimizer and its keyword arguments for the spec's `optimizer` section."""
    kwargs = {"lr": spec["lr"], "weight_decay": spec["weightDecay"]}
    if spec["name"] in ("sgd", "rmsprop"):
        kwargs["momentum"] = spec["momentum"]
    return OPTIMIZERS[spec["name"]], kwargs


# ---- parameter server side (called over RPC) ----


def _make_table(num_embeddings: int, dim: int, mode: str, seed: int) -> nn.EmbeddingBag:
    table = nn.EmbeddingBag(num_embeddings, dim, mode=mode)
    nn.init.normal_(table.weight, generator=torch.Generator().manual_seed(seed))
    return table


def _table_weight(table: rpc.RRef) -> torch.Tensor:
    return table.local_value().weight.detach().clone()


def _parameter_rrefs(table: rpc.RRef) -> list[rpc.RRef]:
    return [rpc.RRef(p) for p in table.local_value().parameters()]


# ---- master ----


class Progress:
    """Prints one line per logged step once every trainer has reported it."""

    def __init__(self, env: Env, trainers: list[str]):
        self.env, self.trainers = env, trainers
        self.steps, self.batch = env.spec["steps"], env.spec["batchSize"]
        self.lock = threading.Lock()
        self.pending: dict[int, dict[str, float]] = {}
        self.created = time.perf_counter()
        self.last_step, self.last_time = 0, self.created

    def report(self, trainer: str, step: int, loss: float) -> None:
        with self.lock:
            losses = self.pending.setdefault(step, {})
            losses[trainer] = loss
            if len(losses) < len(self.trainers):
                return
            del self.pending[step]
            now = time.perf_counter()
            if step == 0:  # every trainer is set up and about to take its first step
                world.log(self.env, f"trainers ready after {now - self.created:.1f}s of setup")
            elif step > self.last_step:
                samples = len(self.trainers) * self.batch * (step - self.last_step)
                rate = samples / max(now - self.last_time, 1e-9)
                mean = sum(losses.values()) / len(losses)
                world.log(self.env, f"step {step}/{self.steps}  loss {mean:.4f}"
                                    f"  {rate:,.0f} samples/s")  # fmt: skip
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
    table = rpc.remote(
        ps, _make_table, args=(emb["numEmbeddings"], emb["dim"], emb["mode"], spec["seed"])
    )
    before = rpc.rpc_sync(ps, _table_weight, args=(table,))
    world.log(env, f"training {spec['steps']} steps x {spec['batchSize']} bags on"
                   f" {', '.join(trainers)}; EmbeddingBag {emb['numEmbeddings']}x{emb['dim']}"
                   f" ({emb['mode']}) on {ps}")  # fmt: skip
    _PROGRESS = Progress(env, trainers)
    # A training loop may run for hours: no RPC timeout (0) on it. A trainer that dies fails
    # its future when its connection breaks.
    futures = [rpc.rpc_async(t, _train, args=(table,), timeout=0) for t in trainers]
    results = dict(zip(trainers, _wait_all(futures), strict=True))
    after = rpc.rpc_sync(ps, _table_weight, args=(table,))
    summary = summarize(env, results, before, after)
    print_summary(env, summary)
    return summary


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

    def __init__(self, table: rpc.RRef, dense: nn.Module, device: torch.device):
        super().__init__()
        self.table, self.dense, self.device = table, dense, device

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        bags = self.table.rpc_sync().forward(ids, offsets)
        return self.dense(bags.to(self.device))


def _device(env: Env) -> torch.device:
    if env.gpus == 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"gpusPerTrainer is {env.gpus} but {env.rpc_name} sees no CUDA device")
    assert env.ddp_rank is not None
    return torch.device("cuda", env.ddp_rank % torch.cuda.device_count())


def _train(table: rpc.RRef) -> dict[str, Any]:
    """One trainer's whole loop; the master calls it over RPC and gets its results."""
    env = _ENV
    assert env is not None and env.ddp_rank is not None and env.ddp_world_size is not None
    spec, seed = env.spec, env.spec["seed"]
    device = _device(env)
    torch.manual_seed(seed)  # DDP broadcasts rank 0's dense weights; seeding makes runs repeat
    linear = nn.Linear(spec["embedding"]["dim"], spec["dense"]["outFeatures"]).to(device)
    dense = DistributedDataParallel(
        linear, device_ids=[device.index] if device.type == "cuda" else None
    )
    model = HybridModel(table, dense, device)
    initial = [p.detach().clone() for p in linear.parameters()]

    params = rpc.rpc_sync(table.owner(), _parameter_rrefs, args=(table,))
    params += [rpc.RRef(p) for p in model.parameters()]
    optimizer_class, kwargs = optimizer_args(spec["optimizer"])
    optimizer = DistributedOptimizer(optimizer_class, params, **kwargs)

    dataset = data.SyntheticBags(
        size=spec["datasetSize"],
        num_embeddings=spec["embedding"]["numEmbeddings"],
        classes=spec["dense"]["outFeatures"],
        bag_size=spec["bagSize"],
        seed=seed,
    )
    part = data.partitions(spec["datasetSize"], env.ddp_world_size, seed)[env.ddp_rank]
    batches = data.batches(dataset, part, spec["batchSize"])
    read: set[int] = set()

    steps, every = spec["steps"], spec["logEvery"]
    report = rpc.rpc_async("master", _report, args=(env.rpc_name, 0, math.nan))
    loss_first = math.nan
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batch = next(batches)
        read.update(batch.sample_ids)
        loss = _step(model, optimizer, batch, device)
        if step == 1:
            loss_first = loss.item()
        if step % every == 0 or step == steps:
            report.wait()  # at most one report in flight; surfaces a failed one
            report = rpc.rpc_async("master", _report, args=(env.rpc_name, step, loss.item()))
    seconds = time.perf_counter() - start
    report.wait()
    moved = [(p.detach() - q).flatten() for p, q in zip(linear.parameters(), initial, strict=True)]

    return {
        "ddp_rank": env.ddp_rank,
        "steps": steps,
        "batch_size": spec["batchSize"],
        "seconds": seconds,
        "samples_per_second": steps * spec["batchSize"] / seconds,
        "loss_first": loss_first,
        "loss_final": loss.item(),
        "dense_change_norm": torch.cat(moved).norm().item(),
        "partition_size": len(part),
        "samples_read": len(read),
        "read": torch.tensor(sorted(read)),
        "dense": {k: v.detach().cpu() for k, v in linear.state_dict().items()},
    }


def _step(model: HybridModel, optimizer: DistributedOptimizer, batch: data.Batch,
          device: torch.device) -> torch.Tensor:  # fmt: skip
    ids, offsets = torch.tensor(batch.ids), torch.tensor(batch.offsets)
    labels = torch.tensor(batch.labels, device=device)
    with dist_autograd.context() as context:
        loss = F.cross_entropy(model(ids, offsets), labels)
        dist_autograd.backward(context, [loss])
        optimizer.step(context)
    return loss
