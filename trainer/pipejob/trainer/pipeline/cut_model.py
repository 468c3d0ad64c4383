"""The model cut into pieces (`CutModel`, `plan_cut`) balanced across the stages by measured
cost; with `microBatches: auto`, the micro-batch count with the shortest predicted step
(micro_batch_choice.py; balance.py, counted_cost.py with spec.deterministic).
The master plans all of it on a model none of whose parameters exist; the stages build their
pieces and measure the costs (stage_build.py)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed.rpc as rpc
from torch import nn

from pipejob.core.kinds.pipeline import AUTO, PIPELINING, PipelineSpec, auto_counts
from pipejob.trainer.pipeline import engine_choice, peft_output
from pipejob.trainer.pipeline.balance import Host, Prediction, UnitCosts, fastest
from pipejob.trainer.pipeline.engine_choice import Choice
from pipejob.trainer.pipeline.micro_batch_choice import candidate, prediction
from pipejob.trainer.pipeline.peft_output import AdapterConfig
from pipejob.trainer.pipeline.run_json import Candidate
from pipejob.trainer.pipeline.stage_base import compute_resources
from pipejob.trainer.pipeline.stage_build import PieceBuilder, measure_on_stages, trace
from pipejob.trainer.runtime import model_files, tuning
from pipejob.trainer.runtime.json_values import JsonObject
from pipejob.trainer.runtime.world import Env
from pipejob.trainer.workloads import cut, materialize, models


def hf_config(model: nn.Module) -> JsonObject | None:
    """A Hugging Face PreTrainedModel's config as its config.json holds it, else None."""
    config = getattr(model, "config", None)
    if hasattr(model, "save_pretrained") and hasattr(config, "to_json_string"):
        return json.loads(config.to_json_string(use_diff=False))
    return None


@dataclass(frozen=True)
class Partition:
    """How the model is split and micro-batched: what a checkpoint keeps, since its pieces
    fit no other split (costs are measured, so a new measurement may cut elsewhere)."""

    ranges: list[range]
    costs: list[float]  # measured seconds of forward + backward per layer, one micro-batch
    micro_batches: int  # the count the costs were measured for, and the run uses
    # With `microBatches: auto`: every candidate's prediction (see `candidate_table`).
    candidates: list[Candidate] = field(default_factory=list)
    # With `engine: auto`: the engine this cut was made for, and why.
    engine: Choice | None = None


@dataclass(frozen=True)
class CutModel:
    """The model cut into pieces (one per stage, or stagesPerProcess per stage process with
    an interleaved schedule) at the boundaries of a partition of its units (cut candidates
    in calling order, cut.Traced), and the model state no stage holds. Stage process k of
    `processes` holds pieces k, k + processes, ... (the interleaved schedules' loop)."""

    units: list[str]
    # Each piece's module: on the meta device where `builders` say how each process builds its
    # own (what `plan_cut` gives); otherwise the modules themselves, sent to the stages.
    stages: list[nn.Module]
    partition: Partition
    rest: dict[str, torch.Tensor]
    # Parameters several stage processes hold (cut.ties, by process): their gradients are
    # summed every step.
    tied: list[list[tuple[int, str]]] = field(default_factory=list)
    # A Hugging Face model's config (config.json), written beside the model file.
    config: JsonObject | None = None
    builders: list[PieceBuilder] | None = None  # one per piece
    processes: int = 0  # stage processes; 0: one per piece
    # The modules' versions a plain `model.state_dict()` carries (its `_metadata`), for the
    # model file: a fresh build of some modules (MNASNet) loads no state without them.
    metadata: model_files.Metadata | None = None
    # A peft model's adapters' configs (pipeline/peft_output.py), for the adapter files.
    adapters: dict[str, AdapterConfig] | None = None

    @property
    def ranges(self) -> list[range]:
        return self.partition.ranges

    def chosen_for(self, choice: Choice) -> CutModel:
        """This cut, made for the engine `engine: auto` chose before the cut."""
        return dataclasses.replace(
            self, partition=dataclasses.replace(self.partition, engine=choice)
        )

    @property
    def costs(self) -> list[float]:
        return self.partition.costs

    def piece_units(self, piece: int) -> list[str]:
        """The names of the units piece `piece` holds."""
        return [self.units[i] for i in self.ranges[piece]]

    def units_by_piece(self) -> list[list[str]]:
        """The names of the units each piece holds, piece by piece (a checkpoint's `stages`)."""
        return [self.piece_units(piece) for piece in range(len(self.ranges))]

    def process_pieces(self, process: int) -> list[int]:
        """The pieces stage process `process` holds."""
        return list(range(process, len(self.ranges), self.processes or len(self.ranges)))

    def process_units(self, process: int) -> list[str]:
        """The names of the units stage process `process` holds, piece by piece."""
        return [u for piece in self.process_pieces(process) for u in self.piece_units(piece)]

    def describe(self, process: int) -> str:
        """What stage process `process` holds, piece by piece: "conv1 .. layer1.2 (5 layers)
        + layer3.0 .. layer3.3 (4 layers)"."""
        return " + ".join(
            describe(self.piece_units(piece)) for piece in self.process_pieces(process)
        )

    def builder(self, process: int) -> PieceBuilder:
        """How stage process `process` builds its pieces: from one build of the model, so a
        tensor two of them use (tied weights) stays one."""
        assert self.builders is not None
        builders = [self.builders[piece] for piece in self.process_pieces(process)]
        keep = tuple(sorted({n for builder in builders for n in builder.keep}))
        pieces = tuple(n for builder in builders for n in builder.pieces)
        return dataclasses.replace(builders[0], keep=keep, pieces=pieces)


def plan_cut(
    spec: PipelineSpec,
    model: nn.Module,
    numbered: materialize.Numbering,
    stage_names: list[str],
    saved: Partition | None = None,
    hosts: list[Host] | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> CutModel:
    """Cut the job's `model`, built with none of its parameters (models.build_meta, which
    gives the `numbered` names), into spec.stages: at spec.splitPoints, or balanced by what
    each unit costs (measured on the stage processes `stage_names`, one pipeline's, on
    micro-batches of the first training batch, which the first stage reads), or as `saved`,
    a checkpoint's partition.
    With `microBatches: auto`, costs are measured at every candidate count's micro-batch
    size and the count with the shortest predicted step (`prediction`: timed, given the
    `hosts` whose cores stages share; counted with spec.deterministic) is used. Each stage
    builds its own pieces from the returned `builders`."""
    traced = trace(spec, model)
    units = traced.units
    if len(units) < spec.pieces:
        raise cut.cut_count_error(len(units), spec.pieces, getattr(traced, "whole", None))
    fixed = traced.ranges(spec.split_points) if spec.split_points else None
    if saved is None:
        saved = _measure(spec, stage_names, traced, numbered, hosts or [], fixed, progress)
    starts = [units[r.start] for r in saved.ranges[1:]]
    stages = traced.split(starts)
    dtype = torch.get_default_dtype()
    builders = [
        PieceBuilder(
            spec,
            dtype,
            tuple(materialize.numbers(numbered, cut.state_names(stage))),
            tuple(starts),
            (k,),
        )
        for k, stage in enumerate(stages)
    ]
    rest = cut.unused(model, stages)
    # Parameters no stage holds, or buffers computed from parameters (the master's are not
    # right: it has no parameters), are built here.
    if any(v.device.type == "meta" or k in numbered.buffers for k, v in rest.items()):
        with torch.random.fork_rng(devices=[]):
            whole, _ = materialize.build(
                lambda: models.build(spec), materialize.numbers(numbered, rest)
            )
        rest = {k: v for k, v in whole.state_dict().items() if k in rest}
    tied = by_process(cut.ties(stages), spec.stages)
    return CutModel(
        units,
        stages,
        saved,
        rest,
        tied,
        hf_config(model),
        builders,
        spec.stages,
        model_files.module_metadata(model),
        peft_output.configs(model),
    )


def by_process(ties: list[list[tuple[int, str]]], processes: int) -> list[list[tuple[int, str]]]:
    """Tied parameters (cut.ties: by piece) by stage process, where piece k is on process
    k % processes: pieces on one process share one tensor (one build), so each process
    keeps its first piece's name; a tie within one process leaves nothing to combine."""
    out = []
    for group in ties:
        first: dict[int, str] = {}
        for piece, name in group:
            first.setdefault(piece % processes, name)
        if len(first) > 1:
            out.append(list(first.items()))
    return out


def _measure(
    spec: PipelineSpec,
    stage_names: list[str],
    traced: cut.Traced,
    numbered: materialize.Numbering,
    hosts: list[Host],
    fixed: list[range] | None,
    progress: Callable[[str], None],
) -> Partition:
    auto = spec.micro_batches == AUTO
    batch = spec.batch_size
    counts = auto_counts(batch, spec.schedule, spec.stages) if auto else [spec.micro_batches]
    for m in counts:
        progress(f"  micro-batch {batch // m} ({m} per batch)")
    sizes = [batch // m for m in counts]
    measured: dict[int, tuple[Prediction, UnitCosts]] = {}
    choice = None
    for m, costs in zip(
        counts, measure_on_stages(stage_names, spec, traced, numbered, sizes), strict=True
    ):
        if spec.engine == AUTO:  # the costs say where the model passes only tensors
            choice = engine_choice.choose(spec, traced.units, tensor_starts(costs), fixed)
            spec = engine_choice.resolved(spec, choice.engine)
        starts = piece_starts(spec, traced.units, costs, fixed)
        measured[m] = (
            prediction(costs, spec.stages, m, batch, hosts, fixed, spec.stages_per_process, starts),
            costs,
        )
    chosen, costs = measured[fastest([p for p, _ in measured.values()]).micro_batches]
    table = [candidate(p) for p, _ in measured.values()] if auto else []
    return Partition(chosen.ranges, costs.seconds, chosen.micro_batches, table, choice)


def piece_starts(
    spec: PipelineSpec, units: list[str], costs: UnitCosts, fixed: list[range] | None
) -> list[bool] | None:
    """Per unit, whether a piece may begin there: anywhere on the rpc engine; on the
    pipelining engine only where the model passes nothing but tensors (torch's
    PipelineStages send no ints or tuples). Refuses split points, or a model, that leave
    too few such places."""
    if spec.engine != PIPELINING or costs.passes_tensors is None:
        return None
    starts = tensor_starts(costs)
    others = [u for u, ok in zip(units, starts, strict=True) if not ok]
    why = (
        "spec.engine pipelining passes only tensors between stages, and the model passes"
        f" other values (ints, tuples) where {', '.join(others)} begin"
    )
    refused = [units[r.start] for r in fixed or [] if not starts[r.start]]
    if refused:
        raise cut.CutError(f"{why}: split elsewhere than {', '.join(refused)} (spec.splitPoints)")
    if sum(starts) < spec.pieces:
        raise cut.CutError(
            f"{why}: too few places are left for {spec.pieces} pieces; use spec.engine rpc"
        )
    return starts


def tensor_starts(costs: UnitCosts) -> list[bool]:
    """Per unit, whether the model passes only tensors into it (the first: its inputs)."""
    if costs.passes_tensors is None:
        return [True] * len(costs.seconds)
    return [True, *costs.passes_tensors[:-1]]


def stage_resources(env: Env, stages: int, gpu: bool) -> tuple[int, list[Host]]:
    """The intra-op threads the stages compute with (each decided by its own tuning, or by
    the user; the count most of them use, ties to the smaller), and the stages of one
    pipeline (`stages` of them) that share a resource: on GPUs (`gpu`), a GPU (the local
    runner lets stages share one where there are fewer than stages); else a host's cores (by
    address, as tuning counts them), with the CPUs they may use: with replicas, a host's
    CPUs are split among the replicas' stages on it, each pipeline getting its share."""
    names = env.names("stage")
    reports = [rpc.rpc_sync(name, compute_resources, args=(gpu,)) for name in names]
    counts = Counter(threads for threads, _, _ in reports)
    threads = min(counts, key=lambda n: (-counts[n], n))
    if gpu:
        places: list[str] = [uuid for _, _, uuid in reports]
        same: Callable[[str, str], bool] = str.__eq__
    else:
        address = dict(zip(env.world, env.addresses, strict=True))
        places, same = [address[name] for name in names], tuning.same_host
    groups: list[list[int]] = []  # indices into `names` of the stages sharing one place
    for k, place in enumerate(places):
        group = [g for g in groups if same(places[g[0]], place)]
        if group:
            group[0].append(k)
        else:
            groups.append([k])
    hosts = []
    for g in groups:
        ours = tuple(k for k in g if k < stages)  # replica 0's stages on this host or GPU
        if ours:
            whole = 1.0 if gpu else min(reports[k][1] for k in g)
            hosts.append(Host(ours, whole * len(ours) / len(g), gpu))
    return threads, hosts


def share(cut_model: CutModel, process: int) -> float:
    """Stage process `process`'s share of the measured cost."""
    mine = sum(
        cut_model.costs[i]
        for piece in cut_model.process_pieces(process)
        for i in cut_model.ranges[piece]
    )
    return mine / sum(cut_model.costs)


def describe(layers: list[str]) -> str:
    if len(layers) == 1:
        return layers[0]
    return f"{layers[0]} .. {layers[-1]} ({len(layers)} layers)"
