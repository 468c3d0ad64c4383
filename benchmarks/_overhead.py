"""overhead.py's master and its stage-side baseline: every system at every micro-batch count
in turns (pipejob's engines through their own step drivers, torch's schedules driven by the
stage processes themselves), then the master's profile of a step. Imported in the world's
processes (benchmarks/ on their PYTHONPATH)."""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.utils.data import DataLoader, TensorDataset

from pipejob.core import spec as spec_module
from pipejob.core.kinds.pipeline_schedules import schedule_refuses
from pipejob.trainer import pipeline, workloads
from pipejob.trainer.pipeline.cut_model import CutModel, plan_cut
from pipejob.trainer.pipeline.pipelining.stage import _meta
from pipejob.trainer.runtime.profiling import Phases
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads import models

RESULT = "@@overhead "
MODELS = {
    "tiny": {"vocabSize": 16, "layers": 8, "width": 8, "heads": 1, "seqLen": 4},
    "small": {"vocabSize": 256, "layers": 8, "width": 64, "heads": 2, "seqLen": 32},
}
INTERLEAVED = ("interleaved-1f1b", "zero-bubble")
# dist.barrier on pipejob's gloo group says it is a Backend used as a ProcessGroup, each time.
warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
BATCHES = 16  # a loader's batches before it starts over
LOADER = "-loader"  # torch-gpipe-loader: torch's GPipe with its batches read from a DataLoader
TORCH_SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
}


def own(system: str) -> str:
    """The pipejob system whose stages run `system`: torch-1f1b's and torch-gpipe-loader's
    are 1f1b's and gpipe's (the pieces torch's schedules run are those pipejob's hold)."""
    return system.removeprefix("torch-").removesuffix(LOADER)


def schedule_of(system: str) -> str:
    """The schedule a system runs: the rpc engine's is GPipe."""
    return "gpipe" if system == "rpc" else own(system)


def say(payload: dict[str, Any]) -> None:
    print(RESULT + json.dumps(payload), flush=True)


class Bench:
    """The master's side of one world (one stage count)."""

    def __init__(self, env: Env, config: dict[str, Any]):
        self.env, self.config = env, config
        self.stages = config["stages"]
        self.names = env.names("stage")[: self.stages]
        self.systems = config["systems"].split(",")
        self.step = 0  # every step of every system: the stages' turnstiles count up
        self._partitions: dict[tuple[str, int], Any] = {}

    def spec(self, model: str, m: int, system: str) -> Any:
        """The job's settings of `system` at `m` micro-batches of the model."""
        schedule = schedule_of(system)
        optimizer: dict[str, Any] = {"name": "sgd", "lr": 0.01}
        if self.config["clip"]:
            optimizer["clipGradNorm"] = self.config["clip"]
        fields = {
            "model": {"transformer": MODELS[model]},
            "stages": self.stages,
            "batchSize": m * self.config["samples"],
            "microBatches": m,
            "engine": "rpc" if system == "rpc" else "pipelining",
            "steps": 10**6,
            "optimizer": optimizer,
            "seed": 0,
            "preflight": {"enabled": False},
        }
        if system != "rpc":
            fields |= {
                "schedule": schedule,
                "stagesPerProcess": 2 if schedule in INTERLEAVED else 1,
            }
        manifest = {
            "apiVersion": "pipejob.dev/v1alpha1",
            "kind": "PipelineJob",
            "metadata": {"name": "overhead"},
            "spec": fields,
        }
        return spec_module.parse(manifest).settings

    def cut_model(self, s: Any) -> CutModel:
        """The cut of the model into s.pieces, measured once and kept for every count."""
        key = (str(s.model), s.pieces)
        model, numbered = models.build_meta(s)
        saved = self._partitions.get(key)
        cut_model = plan_cut(s, model, numbered, self.names, saved)
        self._partitions[key] = cut_model.partition
        return cut_model

    def replicas(self, model: str, m: int, system: str) -> Any:
        s = self.spec(model, m, system)
        return pipeline.replicas_class(s)([self.names], self.cut_model(s), s)

    def refuses(self, system: str, m: int) -> bool:
        schedule = schedule_of(system)
        return schedule_refuses(schedule, self.stages, m) is not None

    def run(self) -> None:
        counts = [int(m) for m in str(self.config["micro_batches"]).split(",")]
        for model in self.config["models"].split(","):
            for m in counts:
                self.one_count(model, m)

    def one_count(self, model: str, m: int) -> None:
        """Every system at `m` micro-batches: built and warmed up, then timed in turns."""
        systems = [s for s in self.systems if not self.refuses(s, m)]
        held: dict[str, Any] = {}  # the pipejob ReplicasBase of each system (torch's too: holders)
        loss_fn = workloads.loss(self.spec(model, m, "rpc"))
        for system in systems:
            mine = own(system)
            if mine not in held:
                held[mine] = self.replicas(model, m, mine)
                self.steps(held[mine], m, loss_fn, max(1, self.config["warmup"]))
            if system.startswith("torch-"):
                self.torch_steps(held[mine], model, m, system, loss_fn, self.config["warmup"])
        loads = [os.getloadavg()[0]]
        times, cpu = self.turns(systems, held, model, m, loss_fn)
        loads.append(os.getloadavg()[0])
        for system, turns in times.items():
            ts = [t for turn in turns for t in turn]
            say(
                {
                    "stages": self.stages,
                    "model": model,
                    "m": m,
                    "system": system,
                    "seconds": statistics.median(ts),
                    "least": min(ts),
                    "steps": ts,
                    "cpu": statistics.median(cpu[system]),
                    # Each turn's median step and CPU a step: overhead.py pairs them with
                    # torch's schedule's in the same turn (`gaps`).
                    "turns": [statistics.median(turn) for turn in turns],
                    "turns_least": [min(turn) for turn in turns],
                    "cpu_turns": cpu[system],
                    "load": loads,  # the 1-minute load average before and after the turns
                }
            )
        if m == 1 and model == "tiny" and not self.config["no_profile"]:
            for system in systems:
                if not system.startswith("torch-"):
                    self.profile(held[system], model, m, system, loss_fn)

    def turns(
        self, systems: list[str], held: dict[str, Any], model: str, m: int, loss_fn: Any
    ) -> tuple[dict[str, list[list[float]]], dict[str, list[float]]]:
        """--repeats turns of every system (--steps steps each), in turn order reversed every
        other turn (so that neither of a pair always runs first): the seconds of each turn's
        steps, and each turn's CPU seconds a step, per system."""
        times: dict[str, list[list[float]]] = {s: [] for s in systems}
        cpu: dict[str, list[float]] = {s: [] for s in systems}
        count = self.config["steps"]
        for turn in range(self.config["repeats"]):
            for system in systems if turn % 2 == 0 else systems[::-1]:
                holder = held[own(system)]
                if system.startswith("torch-"):
                    seconds, used = self.torch_steps(holder, model, m, system, loss_fn, count)
                else:
                    # A reading of the clocks costs CPU too (an RPC to each stage), which
                    # torch's turn does not count: a reading's own cost, measured back to
                    # back, is left out.
                    first = self.cpu(holder)
                    before = self.cpu(holder)
                    seconds = self.steps(holder, m, loss_fn, count)
                    used = self.cpu(holder) - before - (before - first)
                times[system].append(seconds)
                cpu[system].append(used / count)
        return times, cpu

    def steps(self, replicas: Any, m: int, loss_fn: Any, count: int) -> list[float]:
        """The seconds of each of `count` steps through pipejob's step driver, run as the
        master's loop runs them (ReplicasBase.run_steps), as each step's result gives them (the
        pipelining engine's calls of several steps bring their results together)."""
        results = replicas.run_steps(m, range(self.step, self.step + count), loss_fn)
        seconds = [r.pipeline_seconds + r.optimizer_seconds for r in results]
        self.step += count
        return seconds

    def cpu(self, replicas: Any) -> float:
        """The CPU seconds the master and `replicas`' stage processes have used so far."""
        p = replicas.pipelines[0]
        stages = torch.futures.wait_all(
            [rpc.rpc_async(stage.name, time.process_time) for stage in p.stages]
        )
        return time.process_time() + sum(stages)

    def torch_steps(
        self, holder: Any, model: str, m: int, system: str, loss_fn: Any, count: int
    ) -> tuple[list[float], float]:
        """The seconds of each of `count` steps of torch's schedule run by the stages
        themselves, on the pieces of pipejob's pipelining stages `holder` holds: the first
        stage's (a step begins there and ends with its last backward); and the CPU seconds
        the stage processes used in them."""
        if count == 0:
            return [], 0.0
        p = holder.pipelines[0]
        shape = (self.config["samples"] * m, MODELS[model]["seqLen"])
        vocab = MODELS[model]["vocabSize"]
        args = (system.removeprefix("torch-"), m, shape, vocab, loss_fn, count)
        replies = torch.futures.wait_all(
            [rpc.rpc_async(stage.name, torch_steps, args=(stage, *args)) for stage in p.stages]
        )
        return replies[0][0], sum(used for _, used in replies)

    def profile(self, replicas: Any, model: str, m: int, system: str, loss_fn: Any) -> None:
        """One more step under the profiler: the master's parts of it."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            self.steps(replicas, m, loss_fn, 1)
        parts = Phases(prof.events())
        say(
            {
                "stages": self.stages,
                "model": model,
                "m": m,
                "system": system,
                "phases": dict(parts),
                "span": parts.span,
                "between": parts.span - sum(parts.values()),
            }
        )


# ---------------------------------------------------------------------------- on a stage

_runs: dict[tuple[int, str, int], tuple[Any, torch.optim.Optimizer, tuple, Any]] = {}


def torch_steps(
    stage_ref: rpc.RRef,
    schedule: str,
    m: int,
    shape: tuple[int, int],
    vocab: int,
    loss_fn: Any,
    count: int,
) -> tuple[list[float], float]:
    """Runs on a pipelining stage process: `count` steps of torch's `schedule` over this
    stage's pieces (schedule.step, SGD's step, zero_grad), as a user drives it without a
    master, after a barrier of the pipeline; the seconds of each step here, and the CPU
    seconds this process used in them."""
    stage = stage_ref.local_value()
    key = (id(stage), schedule, m)
    if key not in _runs:
        _runs[key] = _build(stage, schedule, m, shape, vocab, loss_fn)
    run, optimizer, batches = _runs[key]
    dist.barrier(group=stage.pipeline)
    seconds, used = [], time.process_time()
    for _ in range(count):
        start = time.perf_counter()
        args, target = next(batches)
        run.step(*args, target=target)
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
    used = time.process_time() - used
    dist.barrier(group=stage.pipeline)
    return seconds, used


def _build(
    stage: Any, schedule: str, m: int, shape: tuple[int, int], vocab: int, loss_fn: Any
) -> tuple[Any, torch.optim.Optimizer, Iterator[tuple[tuple, Any]]]:
    """torch's PipelineStages over the pieces pipejob's stage built (the shapes they learnt
    for this count), the schedule, SGD, and the batches the first and last stages use."""
    samples = shape[0]
    learnt = (True, m, samples)
    stages = [
        PipelineStage(
            module,
            k,
            stage.count,
            stage.device,
            input_args=_meta(stage._metas[learnt, k][0], True),
            output_args=_meta(stage._metas[learnt, k][1], True),
            group=stage.pipeline,
        )
        for k, module in zip(stage.held, stage.modules, strict=True)
    ]

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        if isinstance(output, tuple | list) and len(output) == 1:
            output = output[0]
        return loss_fn(output, target)

    kind = TORCH_SCHEDULES[schedule.removesuffix(LOADER)]
    run = kind(stages if schedule == "interleaved-1f1b" else stages[0], m, loss_fn=loss)
    optimizer = torch.optim.SGD(stage.layers.parameters(), lr=0.01)
    return run, optimizer, _batches(stage, shape, vocab, schedule.endswith(LOADER))


def _batches(
    stage: Any, shape: tuple[int, int], vocab: int, loader: bool
) -> Iterator[tuple[tuple, Any]]:
    """Each step's (inputs, target) on this stage (the first takes inputs, the last the
    target): one fixed batch; or, with `loader`, as a user's loop reads them (torchtitan's
    way): the first and last stages each read the step's batch from a DataLoader of their
    own over the same data, one after the other."""
    generator = torch.Generator().manual_seed(0)
    rows = (BATCHES * shape[0], shape[1])
    inputs, targets = (torch.randint(vocab, rows, generator=generator) for _ in range(2))
    if not loader:
        n = shape[0]
        fixed = ((inputs[:n],) if stage.first else ()), (targets[:n] if stage.last else None)
        while True:
            yield fixed
    data = DataLoader(TensorDataset(inputs, targets), batch_size=shape[0])
    while True:
        for x, y in data:
            yield ((x,) if stage.first else ()), (y if stage.last else None)
