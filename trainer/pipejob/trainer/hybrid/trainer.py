"""A HybridJob trainer: forms the DDP group with the other trainers (its own port), joins
RPC and waits for the master's call of `train`. Its loop looks bags up over RPC, runs the
DDP-replicated dense model and backpropagates with distributed autograd; the backward steps
the table on the ps; then it steps the dense model with its local optimizer on the context's
gradients, overlapped with the next lookup. It reads only its own partition of the data.
Before the first step it checks that the dense module fits the data; with spec.eval, DDP
rank 0 evaluates on held-out bags (evaluate.py)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipejob.core.kinds.hybrid import HybridSpec
from pipejob.trainer import workloads
from pipejob.trainer.hybrid import evaluate
from pipejob.trainer.hybrid.ps import lookup, save_table
from pipejob.trainer.runtime import checkpoint, nonfinite, profiling, world
from pipejob.trainer.runtime.optim import optimizer_args
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads import bags, synthetic


class HybridModel(nn.Module):
    """Sparse part: the remote EmbeddingBag, looked up over RPC. Dense part: the DDP dense
    module (nn.Linear, or the user's from spec.dense.import)."""

    def __init__(self, table: rpc.RRef, trainer: str, dense: nn.Module, device: torch.device):
        super().__init__()
        self.table, self.trainer, self.dense, self.device = table, trainer, dense, device

    def lookup(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.futures.Future:
        """The bags, over RPC; inside a dist-autograd context, so the backward reaches the ps."""
        return rpc.rpc_async(self.table.owner(), lookup,
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


def train(table: rpc.RRef, resume: dict[str, Any] | None = None) -> dict[str, Any]:
    """One trainer's whole loop; the master calls it over RPC and gets its results. With
    `resume` (see master._resume) it continues after the checkpoint's step."""
    from pipejob.trainer.hybrid import master  # it calls this function: imports it first

    env = world.current()
    assert env.ddp_rank is not None and env.ddp_world_size is not None
    spec: HybridSpec = env.spec
    device = _device(env)
    torch.manual_seed(spec.seed)  # DDP broadcasts rank 0's dense weights: runs repeat
    linear = workloads.hybrid_dense(spec).to(device)
    restored = None
    if resume is not None:  # before DDP, which starts from rank 0's weights: the saved ones
        restored = checkpoint.load_part(resume["directory"], resume["dense"])
        linear.load_state_dict(restored["model"])
    dense = DistributedDataParallel(
        linear, device_ids=[device.index] if device.type == "cuda" else None
    )
    model = HybridModel(table, env.rpc_name, dense, device)
    initial = [p.detach().clone() for p in linear.parameters()]
    optimizer_class, kwargs = optimizer_args(spec.optimizer)
    optimizer = optimizer_class(linear.parameters(), **kwargs)  # the ps steps the table
    if restored is not None:
        checkpoint.load_optimizer_state(optimizer, linear, restored["optimizers"]["dense"])
    dense_step = DenseStep(optimizer)
    ps = table.owner().name

    dataset, loss_fn = workloads.hybrid_data(spec), workloads.loss(spec)
    part = synthetic.partitions(dataset.size, env.ddp_world_size, spec.seed)[env.ddp_rank]
    batches = synthetic.batches(dataset, part, spec.batch_size)
    evaluate.check_dense(spec, linear, loss_fn, next(synthetic.batches(dataset, part,
                         spec.batch_size)), device)  # fmt: skip
    held_out = _held_out(env, spec)
    first = 0 if resume is None else resume["step"]
    for _ in range(first):  # the batches of the steps before the checkpoint
        next(batches)
    read: set[int] = set()

    steps, every = spec.steps, spec.log_every
    profile = profiling.settings(spec)
    servers = [ps, "master"] if env.ddp_rank == 0 else []  # profiled along with the trainers
    report = rpc.rpc_async("master", master.report, args=(env.rpc_name, first, math.nan))
    loss_first = math.nan
    start = time.perf_counter()
    for step in range(first + 1, steps + 1):
        batch = next(batches)
        read.update(batch.sample_ids)
        with profiling.window(env, profile, step, servers, sync=dist.barrier) as rpc_calls:
            loss = _step(model, dense_step, batch, device, loss_fn, rpc_calls, step)
        if step == first + 1:
            loss_first = loss.item()
        if evaluate.due(spec, step):  # first: the step's checkpoint keeps its evaluation
            dense_step.flush()
            _evaluate(env, step, table, linear, held_out, loss_fn, device, master.evaluated)
        if checkpoint.due(spec, step):
            dense_step.flush()
            _checkpoint(env, step, table, linear, optimizer, master.write_manifest)
        if step % every == 0 or step == steps:
            report.wait()  # at most one report in flight; surfaces a failed one
            report = rpc.rpc_async("master", master.report,
                                   args=(env.rpc_name, step, loss.item()))  # fmt: skip
    dense_step.flush()
    seconds = time.perf_counter() - start
    report.wait()
    moved = [(p.detach() - q).flatten() for p, q in zip(linear.parameters(), initial, strict=True)]

    return {
        "ddpRank": env.ddp_rank,
        "steps": steps - first,
        "batchSize": spec.batch_size,
        "seconds": seconds,
        "samplesPerSecond": (steps - first) * spec.batch_size / seconds,
        "firstLoss": loss_first,
        "finalLoss": loss.item(),
        "denseChangeNorm": torch.cat(moved).norm().item(),
        "partitionSize": len(part),
        "samplesRead": len(read),
        "read": torch.tensor(sorted(read)),
        "dense": {k: v.detach().cpu() for k, v in linear.state_dict().items()},
    }


def _held_out(env: Env, spec: HybridSpec) -> list[synthetic.Batch] | None:
    """DDP rank 0's held-out batches when spec.eval asks for them (it alone evaluates)."""
    if spec.eval is None or env.ddp_rank != 0:
        return None
    data = workloads.hybrid_held_out(spec)
    if data is None:
        world.log(env, "spec.eval: the data has no held-out split (spec.data.file.val, or"
                       " spec.data.import's split='val'): not evaluating")  # fmt: skip
        return None
    return bags.in_order(data, spec.batch_size, spec.eval.batches)


def _evaluate(env: Env, step: int, table: rpc.RRef, dense: nn.Module,
              held_out: list[synthetic.Batch] | None, loss_fn: workloads.Loss,
              device: torch.device, evaluated: Callable) -> None:  # fmt: skip
    """DDP rank 0 evaluates after `step` and tells the master (`evaluated`, over RPC); the
    others wait, so the table stays as it was after `step`."""
    dist.barrier()
    if held_out is not None:
        figures = evaluate.evaluate(table, dense, held_out, loss_fn, device)
        rpc.rpc_sync("master", evaluated, args=(step, figures))
    dist.barrier()


def _checkpoint(env: Env, step: int, table: rpc.RRef, linear: nn.Module,
                optimizer: torch.optim.Optimizer, write_manifest: Callable) -> None:  # fmt: skip
    """Once every trainer has finished `step`: DDP rank 0 saves the dense layer (the same on
    every rank) with its optimizer state and has the ps save the table; the master writes
    the manifest (`write_manifest`, over RPC). The others wait, so nobody changes the table
    while it is saved."""
    dist.barrier()
    if env.ddp_rank == 0:
        start = time.perf_counter()
        directory = str(checkpoint.step_dir(env.spec.checkpoint.path, step))
        saving = rpc.rpc_async(table.owner(), save_table, args=(table, directory))
        dense = checkpoint.save_module(directory, "dense.pt", linear,
                                       {"dense": optimizer})  # fmt: skip
        files = [saving.wait(), dense]
        rpc.rpc_sync("master", write_manifest, args=(step, files, time.perf_counter() - start))
    dist.barrier()


def _step(model: HybridModel, dense_step: DenseStep, batch: synthetic.Batch,
          device: torch.device, loss_fn: workloads.Loss,
          rpc_calls: profiling.RpcCalls = contextlib.nullcontext,
          step: int = 0) -> torch.Tensor:  # fmt: skip
    """One step; `rpc_calls` wraps its RPCs (the lookup), not DDP's parts. The backward
    steps the table on the ps; the dense layer's step (on gradients DDP averaged across the
    trainers during the backward) is deferred to overlap the next lookup. A loss that is
    not finite stops the job before its backward changes anything (runtime/nonfinite.py)."""
    ids, offsets = torch.tensor(batch.ids), torch.tensor(batch.offsets)
    labels = torch.tensor(batch.labels, device=device)
    with dist_autograd.context() as context:
        with rpc_calls():  # open until the reply: it brings the remote ops' profile
            lookup = model.lookup(ids, offsets)
            dense_step.flush()  # the previous step's, while the lookup is in flight
            bags = lookup.wait()
        loss = loss_fn(model(bags), labels)
        if not nonfinite.finite(loss):
            raise nonfinite.NonFiniteError(
                f"step {step}: the loss is {loss.item()} on {model.trainer}; its update was"
                " not applied"
            )
        dist_autograd.backward(context, [loss])
        dense_step.defer(dist_autograd.get_gradients(context))
    return loss
