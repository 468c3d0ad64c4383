"""PipelineJob: the master drives micro-batches through model shards on the stage workers.

The master builds the model, cuts it into layers, balances them across the stages by cost
measured with the stages' thread count and creates one `Stage` per stage worker with
`rpc.remote`. With `microBatches: auto` it first measures every candidate micro-batch size and
runs the count with the shortest predicted step (partition.predict). Each step splits the
batch into micro-batches; for every micro-batch the master chains RRefs, so stage i+1 fetches
its input from stage i (activations never pass through the master), each stage computes them
in order, and only the last stage's output returns. The loss is computed on the master,
`dist_autograd` runs the backward across the stages and `DistributedOptimizer` steps every
shard's parameters where they live (GPipe: all forwards of a step, then all backwards).

Stage workers only serve: they join the RPC world and wait in `rpc.shutdown()` until the
master is done. Each process computes with the threads it was started with (OMP_NUM_THREADS,
which trainer/tuning.py sets per role before torch loads)."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

from pipejob.core.spec import AUTO
from pipejob.trainer import checkpoint, monitor, profiling, tuning, world
from pipejob.trainer.layers import Layer, build_model, cut, sequential
from pipejob.trainer.optim import optimizer_args
from pipejob.trainer.partition import (
    Host,
    LayerCosts,
    Prediction,
    fastest,
    intra_op_threads,
    measure_costs,
    micro_batch_counts,
    predict,
)
from pipejob.trainer.world import Env

# Micro-batches a stage holds at once; fewer than the RPC worker threads of world.join_rpc.
IN_FLIGHT = 4


# ---------------------------------------------------------------------------- stage side


class Turnstile:
    """Lets callers through one at a time in micro-batch order: (step, 0), (step, 1), ...; a
    later step starts again at 0 (the master begins a step's forwards once the last step's
    have all ended). A step's forwards reach a stage's RPC threads in any order; run as they
    came, stage k could hold back micro-batch 0, which stage k + 1 needs first.

    Every caller must take its turn, even one that failed before computing (it then passes
    the turn on at once), so a failure never leaves the micro-batches after it waiting. The
    master launches each stage's micro-batches in order, so the one whose turn it is has
    always been sent; a turn that does not come within `timeout` is an error, not a hang."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._changed = threading.Condition()
        self._step, self._next = -1, 0  # the last step seen, and its next micro-batch

    def _due(self, step: int, index: int) -> bool:
        if step == self._step:
            return index == self._next
        return step > self._step and index == 0

    @contextmanager
    def turn(self, step: int, index: int) -> Iterator[None]:
        with self._changed:
            if not self._changed.wait_for(lambda: self._due(step, index), self.timeout):
                raise TimeoutError(
                    f"micro-batch {index} of step {step} waited {self.timeout:g}s for its turn"
                    f" (the stage last ran micro-batch {self._next - 1} of step {self._step})"
                )
        try:
            yield
        finally:
            with self._changed:
                self._step, self._next = step, index + 1
                self._changed.notify_all()


def compute_resources() -> tuple[int, float]:
    """Runs on a stage: the intra-op threads its forwards and backwards compute with, and the
    CPUs it may use."""
    return torch.get_num_threads(), tuning.available_cpus()


class Stage:
    """One shard of the model, held by a stage worker and called by the master over RPC.

    It records when it computes, forward and backward, per micro-batch, and keeps per-step
    totals, so the master can report per-stage time and the pipeline's bubble."""

    def __init__(self, layers: list[Layer], last: bool, device: str):
        self.device = torch.device(device)
        self.layers = sequential(layers).to(self.device)
        self.last = last
        # One forward at a time, in micro-batch order: micro-batches would otherwise fight
        # over the same cores and race on BatchNorm's running statistics.
        self._order = Turnstile(world.RPC_TIMEOUT_SECONDS)
        self._record = threading.Lock()
        # [start, end] of "forward" and "backward" per (step, micro-batch) of open steps,
        # folded into per-step totals once a later step starts.
        self._events: dict[tuple[int, int], dict[str, list[float]]] = defaultdict(dict)
        self._totals: dict[int, tuple[float, float, float]] = {}

    def parameter_rrefs(self) -> list[RRef]:
        return [RRef(p) for p in self.layers.parameters()]

    def forward(self, x: torch.Tensor | RRef, step: int, micro_batch: int) -> torch.Tensor:
        failed = None
        try:  # fetching waits for no turn: later inputs arrive while this stage computes
            if not isinstance(x, torch.Tensor):
                x = x.to_here()  # an RRef: fetched from the previous stage, straight to this one
            received = x
            x = x.to(self.device)
        except Exception as e:
            failed = e
        with self._order.turn(step, micro_batch):
            if failed is not None:
                raise failed
            start = time.perf_counter()
            y = self.layers(x)
            if self.device.type == "cuda":  # so the time is the kernels', not their launch's
                torch.cuda.synchronize(self.device)
            end = time.perf_counter()
        with self._record:
            self._fold(before=step)
            self._events[step, micro_batch]["forward"] = [start, end]
        self._time_backward((step, micro_batch), y, received)
        # The master is CPU-only: the last stage hands back CPU tensors.
        return y.cpu() if self.last else y

    def _time_backward(self, key: tuple[int, int], y: torch.Tensor, received: torch.Tensor):
        """Backward through this shard starts when the gradient of `y` arrives and ends when
        the autograd nodes nearest the shard's input have run."""
        if y.grad_fn is None:
            return
        y.grad_fn.register_prehook(lambda grads: self._note(key, "start"))
        for node in input_nodes(y.grad_fn, received.grad_fn):
            node.register_hook(lambda grads_in, grads_out: self._note(key, "end"))

    def _note(self, key: tuple[int, int], what: str) -> None:
        now = time.perf_counter()
        with self._record:
            backward = self._events[key].setdefault("backward", [now, now])
            if what == "start":
                backward[0] = now
            else:
                backward[1] = max(backward[1], now)

    def _fold(self, before: float) -> None:
        for step in sorted({s for s, _ in self._events if s < before}):
            events = [self._events.pop(k) for k in list(self._events) if k[0] == step]
            self._totals[step] = step_seconds(events)

    def timings(self) -> dict[int, tuple[float, float, float]]:
        """Per step: seconds this stage spent in forward, in backward, and busy at all."""
        with self._record:
            self._fold(before=float("inf"))
            return dict(self._totals)

    def save(self, optimizer: RRef | None, directory: str, name: str) -> dict[str, Any]:
        """Checkpoint this shard and its local optimizer's state; the manifest entry."""
        optimizers = {} if optimizer is None else {"optimizer": optimizer.local_value()}
        return checkpoint.save_module(directory, name, self.layers, optimizers)

    def load(self, optimizer: RRef | None, directory: str, entry: dict[str, Any]) -> None:
        optimizers = {} if optimizer is None else {"optimizer": optimizer.local_value()}
        state = checkpoint.load_module(directory, entry, self.layers, optimizers)
        checkpoint.set_rng_state(state["rng"])  # e.g. dropout masks continue as they would


def input_nodes(root: Any, stop: Any) -> list[Any]:
    """The nodes of `root`'s autograd graph nearest the shard's input: those with no further
    node of the shard behind them (only parameters, the input, or the `stop` node that
    carries the gradient on to the previous stage)."""
    found, seen, todo = [], {root}, [root]
    while todo:
        node = todo.pop()
        inner = [f for f, _ in node.next_functions if f is not None and f is not stop]
        inner = [f for f in inner if type(f).__name__ != "AccumulateGrad"]
        if not inner:
            found.append(node)
        for f in inner:
            if f not in seen:
                seen.add(f)
                todo.append(f)
    return found


def stage_devices(
    index: int, stages: list[str], gpus: int
) -> tuple[dict[str, dict[int, int]] | None, list[int] | None]:
    """RPC device maps and devices of stage `index`: with GPUs, its shard lives on cuda:0 and
    activations and gradients go GPU to GPU between neighbouring stages. The master stays
    CPU, so it needs no map."""
    if gpus <= 0:
        return None, None
    neighbours = [stages[j] for j in (index - 1, index + 1) if 0 <= j < len(stages)]
    return {name: {0: 0} for name in neighbours}, [0]


# ---------------------------------------------------------------------------- master side


@dataclass(frozen=True)
class Partition:
    """How the model is split and micro-batched: what a checkpoint keeps, since its shards
    fit no other split (costs are measured, so a new measurement may cut elsewhere)."""

    ranges: list[range]
    costs: list[float]  # measured seconds of forward + backward per layer, one micro-batch
    micro_batches: int  # the count the costs were measured for, and the run uses
    # With `microBatches: auto`: every candidate's prediction (see `candidate_table`).
    candidates: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Shards:
    """The model cut into layers and balanced into contiguous per-stage ranges."""

    layers: list[Layer]
    partition: Partition

    @property
    def ranges(self) -> list[range]:
        return self.partition.ranges

    @property
    def costs(self) -> list[float]:
        return self.partition.costs

    def of(self, stage: int) -> list[Layer]:
        return [self.layers[i] for i in self.ranges[stage]]


def build_shards(
    spec: dict[str, Any],
    saved: Partition | None = None,
    threads: int | None = None,
    hosts: list[Host] | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> Shards:
    """Build the seeded model and split it across spec['stages'] by layer costs measured
    with `threads` intra-op threads (those of the stages), or by `saved`: a checkpoint's
    partition. With `microBatches: auto`, costs are measured at every candidate count's
    micro-batch size and the count with the shortest predicted step (given the `hosts`
    whose cores stages share) is used."""
    torch.manual_seed(spec["seed"])
    layers = cut(build_model(spec["model"], spec["numClasses"]))
    if saved is not None:
        return Shards(layers, saved)
    auto = spec["microBatches"] == AUTO
    batch, size = spec["batchSize"], spec["imageSize"]
    counts = micro_batch_counts(batch) if auto else [spec["microBatches"]]
    measured: dict[int, tuple[Prediction, LayerCosts]] = {}
    try:
        with intra_op_threads(threads):
            for m in counts:
                progress(f"  micro-batch {batch // m} ({m} per batch)")
                costs = measure_costs(layers, torch.randn(batch // m, 3, size, size))
                measured[m] = predict(costs, spec["stages"], m, batch, hosts or []), costs
    except ValueError as e:
        raise ValueError(
            f"spec: model {spec['model']} at imageSize {size} with {spec['stages']} stages: {e}"
        ) from None
    chosen, costs = measured[fastest([p for p, _ in measured.values()]).micro_batches]
    table = [candidate(p) for p, _ in measured.values()] if auto else []
    return Shards(layers, Partition(chosen.ranges, costs.seconds, chosen.micro_batches, table))


def candidate(p: Prediction) -> dict[str, Any]:
    """One row of `microBatches: auto`'s table, as the summary and the checkpoint keep it."""
    return {
        "microBatches": p.micro_batches,
        "microBatchSize": p.micro_batch_size,
        "pipelineBoundSeconds": round(p.pipeline_seconds, 4),
        "coresBoundSeconds": round(p.cores_seconds, 4),
        "predictedStepSeconds": round(p.step_seconds, 4),
        "predictedSamplesPerSecond": round(p.samples_per_second, 2),
    }


def candidate_table(candidates: list[dict[str, Any]], chosen: int) -> str:
    """Per candidate: both bounds of the step (see partition.predict), the prediction."""
    lines = [f"  {'m':>3} {'micro':>5} {'pipeline s':>10} {'cores s':>7} {'predicted s/step':>16}"
             f" {'samples/s':>9}"]  # fmt: skip
    for c in candidates:
        mark = "  <- chosen" if c["microBatches"] == chosen else ""
        lines.append(f"  {c['microBatches']:>3} {c['microBatchSize']:>5}"
                     f" {c['pipelineBoundSeconds']:>10.3f} {c['coresBoundSeconds']:>7.3f}"
                     f" {c['predictedStepSeconds']:>16.3f}"
                     f" {c['predictedSamplesPerSecond']:>9.1f}{mark}")  # fmt: skip
    return "\n".join(lines)


def stage_resources(env: Env) -> tuple[int, list[Host]]:
    """The intra-op threads the stages compute with (each decided by its own tuning, or by
    the user; the count most of them use, ties to the smaller), and the stages that share a
    host's cores (by address, as tuning counts them) with the CPUs they may use."""
    names = env.names("stage")
    reports = [rpc.rpc_sync(name, compute_resources) for name in names]
    counts = Counter(threads for threads, _ in reports)
    address = dict(zip(env.world, env.addresses, strict=True))
    groups: list[list[int]] = []
    for k, name in enumerate(names):
        group = [g for g in groups if tuning.same_host(address[names[g[0]]], address[name])]
        if group:
            group[0].append(k)
        else:
            groups.append([k])
    hosts = [Host(tuple(g), min(reports[k][1] for k in g)) for g in groups]
    return min(counts, key=lambda n: (-counts[n], n)), hosts


def on_stage(stage: RRef, method: str, *args: Any) -> Any:
    """Runs on the stage's worker: call a method of the Stage object held there."""
    return getattr(stage.local_value(), method)(*args)


class Pipeline:
    """The master's handle on the remote shards: creates them and runs micro-batches.

    Calls go through `on_stage` rather than RRef proxies (`rref.rpc_async().forward`): a
    proxy's first call is sent from a callback thread once it has fetched the RRef's type,
    outside the distributed autograd context, which silently drops that micro-batch's
    gradients."""

    def __init__(self, stage_names: list[str], shards: Shards, device: str = "cpu"):
        last = len(stage_names) - 1
        self.names = stage_names
        self.stages = [
            rpc.remote(name, Stage, args=(shards.of(i), i == last, device))
            for i, name in enumerate(stage_names)
        ]

    def forward(self, images: torch.Tensor, micro_batches: int, step: int) -> torch.Tensor:
        """All micro-batches' forwards, pipelined; the last stage's outputs, in order.

        Stage k gets micro-batch i's input as stage k-1's RRef and fetches it from there. A
        stage holds at most IN_FLIGHT micro-batches at a time: each waits for its input, then
        for its turn (the stage computes them in order), on one of the stage's RPC threads,
        and once every thread waits, none is left to complete the fetches they wait for. Each
        stage's micro-batches are launched in order, so the one whose turn it is is always
        among those it holds. Completions only post to a queue; every call is issued from
        this thread, inside the distributed autograd context."""
        last = len(self.stages) - 1
        inputs = [x.clone() for x in images.tensor_split(micro_batches)]  # views ship it all
        refs: dict[tuple[int, int], RRef] = {}
        finished: queue.SimpleQueue = queue.SimpleQueue()

        def launch(k: int, mb: int) -> None:
            args = (self.stages[k], "forward", inputs[mb] if k == 0 else refs[k - 1, mb], step, mb)
            if k == last:
                future = rpc.rpc_async(self.names[k], on_stage, args=args)
            else:
                refs[k, mb] = rpc.remote(self.names[k], on_stage, args=args)
                future = refs[k, mb]._get_future()  # done once the stage has computed it
            future.then(lambda f: finished.put((k, mb, f)))

        launched = [0] * (last + 1)  # micro-batches launched on each stage, in order
        busy = [0] * (last + 1)

        def fill() -> None:
            # Completions arrive in any order (stage k may report micro-batch i before stage
            # k-1 does): launch only once the input's RRef exists and the stage has a slot.
            for k in range(last + 1):
                while (launched[k] < micro_batches and busy[k] < IN_FLIGHT
                       and (k == 0 or launched[k] < launched[k - 1])):  # fmt: skip
                    launch(k, launched[k])
                    launched[k] += 1
                    busy[k] += 1

        fill()
        outputs: dict[int, torch.Tensor] = {}
        for _ in range((last + 1) * micro_batches):
            try:
                k, mb, future = finished.get(timeout=world.RPC_TIMEOUT_SECONDS)
            except queue.Empty:
                raise TimeoutError(
                    f"no stage finished a forward within {world.RPC_TIMEOUT_SECONDS:g}s"
                ) from None
            value = future.wait()  # raises if the stage failed
            if k == last:
                outputs[mb] = value
            busy[k] -= 1
            fill()
        return torch.cat([outputs[mb] for mb in range(micro_batches)])

    def parameter_rrefs(self) -> list[RRef]:
        return [p for params in self._each("parameter_rrefs") for p in params]

    def timings(self) -> list[dict[int, tuple[float, float, float]]]:
        return self._each("timings")

    def _each(self, method: str) -> list[Any]:
        return [
            rpc.rpc_sync(name, on_stage, args=(stage, method))
            for name, stage in zip(self.names, self.stages, strict=True)
        ]


def make_optimizer(pipeline: Pipeline, spec: dict[str, Any]) -> DistributedOptimizer:
    """One optimizer per stage, stepping each shard's parameters where they live."""
    cls, kwargs = optimizer_args(spec["optimizer"])
    return DistributedOptimizer(cls, pipeline.parameter_rrefs(), **kwargs)


class SyntheticImages:
    """Seeded random images whose class shifts their colour: deterministic, and learnable."""

    def __init__(self, spec: dict[str, Any]):
        self.generator = torch.Generator().manual_seed(spec["seed"])
        self.size = (spec["batchSize"], 3, spec["imageSize"], spec["imageSize"])
        self.colours = torch.randn(spec["numClasses"], 3, 1, 1, generator=self.generator)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(len(self.colours), self.size[:1], generator=self.generator)
        images = torch.randn(self.size, generator=self.generator) + self.colours[labels]
        return images, labels


@dataclass(frozen=True)
class StepResult:
    loss: float
    pipeline_seconds: float  # forwards and backwards, all micro-batches
    optimizer_seconds: float


def forward_backward(
    pipeline: Pipeline,
    images: torch.Tensor,
    labels: torch.Tensor,
    micro_batches: int,
    step: int,
    context_id: int,
) -> torch.Tensor:
    """Every micro-batch forward, one loss over the whole batch (the mean over its samples,
    as without a pipeline), then the backward across the stages. Returns the loss."""
    outputs = pipeline.forward(images, micro_batches, step)
    loss = F.cross_entropy(outputs, labels)
    dist_autograd.backward(context_id, [loss])
    return loss


def train_step(
    pipeline: Pipeline,
    optimizer: DistributedOptimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    micro_batches: int,
    step: int,
) -> StepResult:
    """One GPipe step: forwards, backwards, then every stage's optimizer step."""
    with dist_autograd.context() as context_id:
        start = time.perf_counter()
        loss = forward_backward(pipeline, images, labels, micro_batches, step, context_id)
        middle = time.perf_counter()
        optimizer.step(context_id)
    return StepResult(loss.item(), middle - start, time.perf_counter() - middle)


def run(env: Env) -> dict[str, Any] | None:
    if env.role == "master":
        return run_master(env)
    devices = stage_devices(env.role_index, env.names("stage"), env.gpus)
    world.join_rpc(env, *devices)
    rpc.shutdown()  # serves the master until it is done
    return None


def run_master(env: Env) -> dict[str, Any]:
    world.join_rpc(env)
    try:
        summary = train(env)
    except BaseException:
        rpc.shutdown(graceful=False)  # a failed world cannot finish together
        raise
    rpc.shutdown()
    return summary


def train(env: Env) -> dict[str, Any]:
    spec = env.spec
    steps, size = spec["steps"], spec["imageSize"]
    board = monitor.board()
    names = env.names("stage")
    found = checkpoint.latest_for(env)
    if found is None:
        threads, hosts = stage_resources(env)
        shared = "; ".join(f"{', '.join(names[k] for k in h.stages)} share {h.cpus:g} CPU(s)"
                           for h in hosts if len(h.stages) > 1)  # fmt: skip
        world.log(env, f"{spec['model']}: measuring layer costs at {size}x{size} with"
                       f" {threads} intra-op thread(s), as the stages compute"
                       + (f" ({shared})" if shared else ""))  # fmt: skip
        if spec["gpusPerStage"] > 0:
            hosts = []  # the stages compute on their GPUs, not on the cores they share
        shards = build_shards(spec, None, threads, hosts, lambda message: world.log(env, message))
    else:
        shards = build_shards(spec, saved_partition(env, found))
    m, candidates = shards.partition.micro_batches, shards.partition.candidates
    if spec["microBatches"] == AUTO:
        how = "chose" if found is None else "resumes with the checkpoint's"
        table = ":\n" + candidate_table(candidates, m) if candidates else ""
        world.log(env, f"microBatches auto {how} {m} (micro-batches of"
                       f" {spec['batchSize'] // m}){table}")  # fmt: skip
    for i, name in enumerate(names):
        layers = [n for n, _ in shards.of(i)]
        world.log(env, f"{name}: {describe(layers)}, {share(shards, i):.0%} of measured cost")
    device = "cuda:0" if spec["gpusPerStage"] > 0 else "cpu"
    pipeline = Pipeline(names, shards, device)
    optimizer = make_optimizer(pipeline, spec)
    data = SyntheticImages(spec)
    first = 0 if found is None else resume(env, found, pipeline, optimizer, data, shards)
    profile = profiling.settings(spec)
    results: list[StepResult] = []
    started = time.perf_counter()
    board.phase("training")
    for step in range(first, steps):
        images, labels = data.batch()
        with profiling.window(env, profile, step + 1, names) as rpc_calls, rpc_calls():
            result = train_step(pipeline, optimizer, images, labels, m, step)
        results.append(result)
        seconds = result.pipeline_seconds + result.optimizer_seconds
        board.step(step + 1, result.loss, seconds, spec["batchSize"])
        if checkpoint.due(spec, step + 1):
            save_checkpoint(env, step + 1, pipeline, optimizer, data, shards)
        if (step + 1) % spec["logEvery"] == 0 or step + 1 == steps:
            rate = spec["batchSize"] / seconds
            world.log(env, f"step {step + 1}/{steps}  loss {result.loss:.4f}  {rate:.1f} samples/s")
            board.stages(*stage_report(names, pipeline.timings(), step, result))
    if not results:
        world.log(env, f"the checkpoint of step {first} completes all {steps} steps: nothing"
                       " left to train")  # fmt: skip
        return {"kind": "PipelineJob", "steps": 0, "resumedFromStep": first}
    summary = summarise(spec, names, shards, results, pipeline.timings(), first)
    summary["resumedFromStep"] = None if found is None else first
    summary["wallSeconds"] = round(time.perf_counter() - started, 3)
    world.log(env, "summary:\n" + render(summary))
    return summary


# ---------------------------------------------------------------------------- checkpoints


def save_checkpoint(env: Env, step: int, pipeline: Pipeline, optimizer: DistributedOptimizer,
                    data: SyntheticImages, shards: Shards) -> None:  # fmt: skip
    """Each stage saves its shard and its optimizer's state, the master its RNG states and
    the partition; the master's manifest, written last, makes the step count."""
    root = env.spec["checkpoint"]["path"]
    directory = str(checkpoint.step_dir(root, step))
    start = time.perf_counter()
    local = checkpoint.local_optimizers(optimizer)
    saving = [
        rpc.rpc_async(
            name, on_stage, args=(stage, "save", local.get(name), directory, f"{name}.pt")
        )  # fmt: skip
        for name, stage in zip(pipeline.names, pipeline.stages, strict=True)
    ]
    master = {"rng": checkpoint.rng_state(), "data": data.generator.get_state()}
    files = [checkpoint.save_part(directory, "master.pt", master), *torch.futures.wait_all(saving)]
    checkpoint.write_manifest(
        root, step, files, kind=env.kind, job=env.job, model=env.spec["model"],
        stageCount=len(shards.ranges),
        stages=[[n for n, _ in shards.of(i)] for i in range(len(shards.ranges))],
        ranges=[[r.start, r.stop] for r in shards.ranges], costs=shards.costs,
        microBatches=shards.partition.micro_batches,
        microBatchCandidates=shards.partition.candidates,
    )  # fmt: skip
    checkpoint.prune(root)
    size = sum(f["bytes"] for f in files) / 1e6
    world.log(env, f"checkpoint of step {step}: {len(files)} files, {size:.1f} MB in"
                   f" {time.perf_counter() - start:.2f}s ({directory})")  # fmt: skip


def saved_partition(env: Env, found: checkpoint.Checkpoint) -> Partition:
    """The checkpoint's split of the layers and micro-batch count: its shards fit no other
    split, and the run continues with the count it was trained with (`auto` takes the
    checkpoint's; another explicit count is refused)."""
    requested, manifest = env.spec["microBatches"], found.manifest
    recorded = manifest.get("microBatches")  # None: written before the count was kept
    if requested == AUTO and recorded is None:
        raise checkpoint.CheckpointError(
            f"{found.directory} does not record its micro-batch count, which microBatches"
            " auto would reuse; set spec.microBatches to the count it was trained with"
        )
    same = {} if requested == AUTO or recorded is None else {"microBatches": requested}
    checkpoint.fits(found, env, model=env.spec["model"], stageCount=env.spec["stages"], **same)
    return Partition([range(a, b) for a, b in manifest["ranges"]], manifest["costs"],
                     recorded or requested, manifest.get("microBatchCandidates", []))  # fmt: skip


def resume(
    env: Env,
    found: checkpoint.Checkpoint,
    pipeline: Pipeline,
    optimizer: DistributedOptimizer,
    data: SyntheticImages,
    shards: Shards,
) -> int:
    """Load every stage's shard and optimizer state and the master's RNG states; the step
    the checkpoint was taken after."""
    layers = [[n for n, _ in shards.of(i)] for i in range(len(shards.ranges))]
    if layers != found.manifest["stages"]:
        raise checkpoint.CheckpointError(
            f"{found.directory} was written for other layers than {env.spec['model']}'s;"
            " give this job another checkpoint.path"
        )
    local = checkpoint.local_optimizers(optimizer)
    directory = str(found.directory)
    loading = []
    for name, stage in zip(pipeline.names, pipeline.stages, strict=True):
        args = (stage, "load", local.get(name), directory, found.entry(f"{name}.pt"))
        loading.append(rpc.rpc_async(name, on_stage, args=args))
    master = found.load("master.pt")
    checkpoint.set_rng_state(master["rng"])
    data.generator.set_state(master["data"])
    torch.futures.wait_all(loading)
    world.log(env, f"resumed from step {found.step} ({found.directory})")
    monitor.board().resumed(found.step)
    return found.step


def stage_report(
    names: list[str], timings: list[dict[int, tuple[float, float, float]]], step: int,
    result: StepResult,
) -> tuple[float, dict[str, tuple[float, float]]]:  # fmt: skip
    """One step's measured bubble and each stage's (forward, backward) seconds."""
    per_stage = [t.get(step, (0.0, 0.0, 0.0)) for t in timings]
    busy = sum(b for _, _, b in per_stage)
    bubble = max(0.0, 1 - busy / (len(per_stage) * result.pipeline_seconds))
    return bubble, {n: (f, b) for n, (f, b, _) in zip(names, per_stage, strict=True)}


# ---------------------------------------------------------------------------- summary


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: time a stage was computing."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def step_seconds(events: list[dict[str, list[float]]]) -> tuple[float, float, float]:
    """One stage's forward, backward and busy seconds in one step, from its micro-batches'
    [start, end] intervals. Backwards of micro-batches interleave in the autograd engine, so
    these are lengths of unions, not sums."""
    forward = [tuple(e["forward"]) for e in events if "forward" in e]
    backward = [tuple(e["backward"]) for e in events if "backward" in e]
    return busy_seconds(forward), busy_seconds(backward), busy_seconds(forward + backward)


def gpipe_bubble(stages: int, micro_batches: int) -> float:
    """Idle fraction of a balanced GPipe pipeline: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def share(shards: Shards, stage: int) -> float:
    return sum(shards.costs[i] for i in shards.ranges[stage]) / sum(shards.costs)


def describe(layers: list[str]) -> str:
    if len(layers) == 1:
        return layers[0]
    return f"{layers[0]} .. {layers[-1]} ({len(layers)} layers)"


def summarise(
    spec: dict[str, Any],
    names: list[str],
    shards: Shards,
    results: list[StepResult],
    timings: list[dict[int, tuple[float, float, float]]],
    first: int = 0,
) -> dict[str, Any]:
    """The run's summary; `results` are of steps first, first + 1, ... Rates and times leave
    out the first step (warm-up: lazy allocations, optimizer state) unless it is the only
    one."""
    warmup = 1 if len(results) > 1 else 0
    measured = results[warmup:]
    steps = range(first + warmup, first + len(results))
    seconds = sum(r.pipeline_seconds + r.optimizer_seconds for r in measured)
    pipeline_wall = sum(r.pipeline_seconds for r in measured)
    per_stage, busy_total = [], 0.0
    for i, (name, per_step) in enumerate(zip(names, timings, strict=True)):
        forward, backward, busy = (sum(per_step[s][k] for s in steps) for k in range(3))
        busy_total += busy
        per_stage.append(
            {
                "stage": name,
                "layers": [n for n, _ in shards.of(i)],
                "costShare": round(share(shards, i), 4),
                "forwardSeconds": round(forward / len(measured), 4),
                "backwardSeconds": round(backward / len(measured), 4),
                "idleFraction": round(1 - busy / pipeline_wall, 4),
            }
        )
    p, m = spec["stages"], shards.partition.micro_batches
    return {
        "kind": "PipelineJob",
        "model": spec["model"],
        "stages": p,
        "microBatches": m,
        "microBatchesRequested": spec["microBatches"],  # a count, or "auto"
        "microBatchCandidates": shards.partition.candidates,  # auto's predictions
        "batchSize": spec["batchSize"],
        "imageSize": spec["imageSize"],
        "steps": len(results),
        "warmupStepsExcluded": warmup,
        "losses": [round(r.loss, 6) for r in results],
        "finalLoss": results[-1].loss,
        "samplesPerSecond": round(spec["batchSize"] * len(measured) / seconds, 3),
        "secondsPerStep": round(seconds / len(measured), 4),
        "optimizerSecondsPerStep": round(
            sum(r.optimizer_seconds for r in measured) / len(measured), 4
        ),
        "partition": per_stage,
        "bubble": {
            "measured": round(1 - busy_total / (p * pipeline_wall), 4),
            "gpipeIdeal": round(gpipe_bubble(p, m), 4),
        },
    }


def auto_line(s: dict[str, Any]) -> list[str]:
    """How `microBatches: auto`'s prediction for its choice compares with the run."""
    chosen = [c for c in s["microBatchCandidates"] if c["microBatches"] == s["microBatches"]]
    if s["microBatchesRequested"] != AUTO or not chosen:
        return []
    measured = s["secondsPerStep"] - s["optimizerSecondsPerStep"]
    return [f"  microBatches auto chose {s['microBatches']} of"
            f" {', '.join(str(c['microBatches']) for c in s['microBatchCandidates'])}:"
            f" predicted {chosen[0]['predictedStepSeconds']:.3f} s of forwards and backwards"
            f" per step, measured {measured:.3f}"]  # fmt: skip


def render(summary: dict[str, Any]) -> str:
    s = summary
    lines = [
        f"  {s['model']}: {s['stages']} stages, {s['microBatches']} micro-batches of"
        f" {s['batchSize'] // s['microBatches']}, {s['imageSize']}x{s['imageSize']} images,"
        f" {s['steps']} steps",
        f"  final loss {s['finalLoss']:.4f}; {s['samplesPerSecond']:.1f} samples/s,"
        f" {s['secondsPerStep']:.3f} s/step"
        + (" (step 1 is warm-up, left out)" if s["warmupStepsExcluded"] else ""),
        *auto_line(s),
        f"  {'stage':<8} {'layers':<38} {'cost':>5} {'fwd s/step':>10} {'bwd s/step':>10}"
        f" {'idle':>5}",
    ]
    for st in s["partition"]:
        lines.append(
            f"  {st['stage']:<8} {describe(st['layers']):<38} {st['costShare']:>5.0%}"
            f" {st['forwardSeconds']:>10.3f} {st['backwardSeconds']:>10.3f}"
            f" {st['idleFraction']:>5.0%}"
        )
    b = s["bubble"]
    lines.append(
        f"  bubble {b['measured']:.0%} measured (idle share of stage time during forward and"
        f" backward), GPipe ideal (p-1)/(m+p-1) = {b['gpipeIdeal']:.0%}"
    )
    return "\n".join(lines)
