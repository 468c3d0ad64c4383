"""What a stage process holds on either engine (`StageBase`): its part of the model, built there
from a `PieceBuilder`, and what the master asks of it over RPC whatever moves its micro-batches (its
state, checkpoints, the model file's shard, fingerprints, gradients, the forward in the job's
precision). Each engine's Stage (rpc/stage.py, pipelining/stage.py) extends it with how its
micro-batches run and where its gradients live (docs/architecture.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.futures import Future

from pipejob.core.averaged import Ema
from pipejob.core.optimizer import Optimizer
from pipejob.trainer.pipeline import gradients, stage_groups
from pipejob.trainer.pipeline.gpu_worker import GpuWorker
from pipejob.trainer.pipeline.reader import Reader, Source
from pipejob.trainer.pipeline.stage_build import PieceBuilder
from pipejob.trainer.pipeline.stage_calls import StageRef, remote_reader
from pipejob.trainer.runtime import checkpoint, ema, model_files, state_by_name, tuning
from pipejob.trainer.runtime.checkpoint_format import FileEntry
from pipejob.trainer.runtime.model_files import ShardWritten
from pipejob.trainer.runtime.optim import Functional, set_lr
from pipejob.trainer.runtime.rendezvous import RPC_TIMEOUT_SECONDS
from pipejob.trainer.workloads import batch_values

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
MOST_STEPS_A_CALL = 32  # in one call of the pipelining engine (its Stage.train)
# Each stage's finite flags of the steps the master may still judge: those of the call it
# reads and of the one sent after it.
FINITE_STEPS_KEPT = 2 * MOST_STEPS_A_CALL


class Computed(nn.Module):
    """A piece of the model as a stage computes it: in the job's precision (`autocast`: the
    dtype, None for float32; weights stay float32) and, with activation checkpointing
    (`recompute`), keeping only its inputs for a backward that recomputes the rest
    (torch.utils.checkpoint, non-reentrant: its backward runs inside whichever autograd
    engine drives it, distributed autograd's too, where a reentrant one would put the
    gradients outside the step's context). The last piece hands float32 to the loss."""

    def __init__(
        self,
        layers: nn.Module,
        device: torch.device,
        autocast: torch.dtype | None,
        recompute: bool,
        last: bool,
    ):
        super().__init__()
        self.layers, self.device_type = layers, device.type
        self.autocast, self.recompute, self.last = autocast, recompute, last

    def forward(self, *x: Any, **kwargs: Any) -> Any:
        with torch.autocast(
            self.device_type,
            dtype=self.autocast or torch.bfloat16,
            enabled=self.autocast is not None,
        ):
            if self.recompute and torch.is_grad_enabled():  # an evaluation keeps nothing
                y = torch.utils.checkpoint.checkpoint(
                    self.layers, *x, use_reentrant=False, **kwargs
                )
            else:
                y = self.layers(*x, **kwargs)
        return float32(y) if self.last and self.autocast is not None else y


def fingerprint(module: nn.Module) -> torch.Tensor:
    """Per parameter of `module`, its sum and sum of squares in float64: equal in every
    replica whose parameters are the same."""
    rows = [
        (p.detach().double().sum(), p.detach().double().square().sum()) for p in module.parameters()
    ]
    return torch.tensor([[a.item(), b.item()] for a, b in rows], dtype=torch.float64)


def float32(value: Any) -> Any:
    """Floating tensors of an output (a tensor, a tuple or list, a dict) as float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        return type(value)(float32(v) for v in value)
    if isinstance(value, dict):
        return type(value)(**{k: float32(v) for k, v in value.items()})  # a ModelOutput too
    return value


def union(pieces: list[nn.Module]) -> nn.Module:
    """One module holding every parameter and buffer of `pieces` under its own name (the
    model's: the pieces keep them), each tensor once: what a process holding several pieces
    checkpoints, writes out and steps. Pieces built from one model share tied tensors. Its
    modules only hold the tensors: modes (train, eval) are the pieces' own."""
    if len(pieces) == 1:
        return pieces[0]
    whole = nn.Module()
    for piece in pieces:
        for path, module in piece.named_modules():
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            for name, tensor in own:
                holder = whole
                for part in filter(None, path.split(".")):
                    if part not in holder._modules:
                        holder.add_module(part, nn.Module())
                    holder = holder._modules[part]
                if isinstance(tensor, nn.Parameter):
                    holder.register_parameter(name, tensor)
                else:
                    holder.register_buffer(name, tensor)
    return whole


def compute_resources(gpu: bool) -> tuple[int, float, str | None]:
    """Runs on a stage: the intra-op threads its forwards and backwards compute with, the
    CPUs it may use and, where it computes on a GPU (`gpu`), which one (its UUID)."""
    uuid = str(torch.cuda.get_device_properties(0).uuid) if gpu else None
    return torch.get_num_threads(), tuning.available_cpus(), uuid


class StageBase:
    """One stage process's part of the model: the pieces it computes (one, or several with
    an interleaved schedule) and `layers`, all of their parameters and buffers under the
    model's own names; the `optimizer` that steps them; the first stage's `reader` of the
    rounds' data."""

    # Where the gradients of the same stage of other replicas are: a process group
    # (None: the default one).
    replicas_group: Any = None
    # The rpc engine's GPU stage computes on a thread and stream of its own (gpu_worker.py).
    gpu: GpuWorker | None = None
    average: ema.Average | None = None  # spec.ema's (keep_average)
    # The step's gradients are the parameters' .grad (the pipelining engine's), which the
    # optimizer reads itself: no mapping of them is made for its step.
    grads_in_place = False

    def __init__(
        self,
        builder: PieceBuilder | nn.Module,
        device: str,
        precision: str = "fp32",
        recompute: bool = False,
        source: Source | None = None,
        optimizer: Optimizer | None = None,
    ):
        self.device = torch.device(device)
        if stage_groups.divided():  # a pipelining or auto world: its stage index's group
            self.replicas_group = stage_groups.mine()[1]
        self.reader = Reader(source, self.device)  # reads only on a first stage
        # Built here from a PieceBuilder: only this process's parameters exist.
        pieces = builder.build() if isinstance(builder, PieceBuilder) else [builder]
        self.pieces = [piece.to(self.device) for piece in pieces]
        self.layers = union(self.pieces)
        # By name, looked up every step (named_parameters walks the modules each time); the
        # same tensors as the optimizer's, for the shard's life.
        self.parameters_by_name = dict(self.layers.named_parameters())
        # None: a pipeline that only computes (tests, evaluation); the master steps none.
        self.optimizer = (
            None if optimizer is None else Functional(optimizer, self.layers.named_parameters())
        )
        self.autocast = AUTOCAST[precision]  # spec.precision
        self.recompute = recompute  # spec.activationCheckpointing
        # Per step, of the last FINITE_STEPS_KEPT (the master may send steps before it has
        # judged the last), per training round: whether each forward's outputs were finite
        # (tensors, read only when the master asks where a non-finite loss came from).
        self._finite: dict[int, dict[int, list[torch.Tensor]]] = {}
        self._finite_lock = threading.Lock()
        self._first: StageRef | None = None  # the first stage: its reader has labels

    def __getstate__(self) -> dict[str, list[torch.Tensor]]:
        """What pickling a Stage gives: the tensors it holds. An RPC agent with CUDA devices
        pickles every RRef's value to find its tensors, whose streams it synchronises before
        the value is used (torch._jit_internal._extract_tensors); locks, threads and a
        user's module need not pickle for that. A Stage is never sent anywhere."""
        return {"tensors": [*self.layers.parameters(), *self.layers.buffers()]}

    def __setstate__(self, state: dict[str, list[torch.Tensor]]) -> None:
        raise TypeError("a Stage cannot be unpickled: it lives on its stage worker")

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """The pieces in eval mode (BatchNorm's statistics used, not updated; no Dropout)
        and without autograd, inside the block."""
        for piece in self.pieces:
            piece.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for piece in self.pieces:
                piece.train()

    def settle_device(self) -> None:
        """On a GPU, wait for everything this process queued there (a forward of a round's
        first micro-batch and every other call over RPC: torch's optimizer step runs on the
        RPC agent's streams, which this stage's stream does not follow)."""
        if self.gpu is not None:
            self.gpu.settle()

    @contextmanager
    def settled(self) -> Iterator[None]:
        """A call touching the shard's state on a GPU: after what ran before it, on any
        stream, and done before what runs next (the optimizer's step reads the gradients it
        changes)."""
        self.settle_device()
        yield
        self.settle_device()

    def computed(self, piece: nn.Module, last: bool) -> Computed:
        return Computed(piece, self.device, self.autocast, self.recompute, last)

    def meet_first(self, stage: StageRef) -> None:
        """Remember the first stage (`stage`), whose reader has each round's labels
        (`labels`): the last stage's loss needs them."""
        self._first = stage

    def labels(self, round: int) -> torch.Tensor:
        """Round `round`'s labels on this stage's device (`ask_labels`)."""
        return batch_values.to(self.ask_labels(round).wait(), self.device)

    def ask_labels(self, round: int) -> Future[torch.Tensor]:
        """The future of round `round`'s labels, from the first stage's reader, which waits
        for the round to be read. A call of the stage's own, naming the first stage as the
        master did once (`meet_first`): the master passing an RRef a round cost several
        messages more."""
        assert self._first is not None, "the master names the first stage to the last"
        return remote_reader(self._first).future(Reader.labels, round, RPC_TIMEOUT_SECONDS)

    # ------------------------------------------------------------------ non-finite values

    def note_finite(self, step: int, round: int, finite: torch.Tensor) -> None:
        """Whether a training forward of round `round` of step `step` gave finite outputs
        (nonfinite.all_finite); steps before the last FINITE_STEPS_KEPT are forgotten."""
        with self._finite_lock:
            self._finite.setdefault(step, {}).setdefault(round, []).append(finite)
            while len(self._finite) > FINITE_STEPS_KEPT:
                del self._finite[next(iter(self._finite))]

    def nonfinite(self, rounds: list[int]) -> bool:
        """Whether any of this stage's outputs in training rounds `rounds` (of one of the last
        FINITE_STEPS_KEPT steps) was not finite."""
        with self._finite_lock:
            flags = [f for step in self._finite.values() for r in rounds for f in step.get(r, [])]
        return not all(bool(f) for f in flags)

    # ------------------------------------------------------------------ gradients

    def gradients(self, context_id: int) -> dict[str, torch.Tensor]:
        """This step's gradients by parameter name (`context_id`: the rpc engine's
        distributed autograd context), for the recipe (gradients.py) to read and change in
        place where the optimizer's step reads them."""
        raise NotImplementedError

    def timings(self, step: int | None = None) -> dict[int, tuple[float, float, float]]:
        """Per step (of every finished one, or only `step`): seconds this stage spent in
        forward, in backward, and busy at all (each engine's Stage keeps them its way)."""
        raise NotImplementedError

    def average_gradients(self, context_id: int) -> float:
        """With replicas: average this shard's gradients of a step with those of the same
        stage of every other replica (`replicas_group`), in place. Returns the seconds the
        all-reduce took."""
        import torch.distributed as dist

        start = time.perf_counter()
        # Every replica holds the same shard, so the same parameters have gradients.
        tensors = list(self.gradients(context_id).values())
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=self.replicas_group)
        flat /= dist.get_world_size(self.replicas_group)
        for t, averaged in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(averaged.view_as(t))
        return time.perf_counter() - start

    def gradient(self, context_id: int, name: str) -> torch.Tensor:
        """Parameter `name`'s gradient this step, on the CPU (zero when it got none)."""
        grad = self.gradients(context_id).get(name)
        if grad is None:
            return torch.zeros_like(self.layers.get_parameter(name), device="cpu")
        return grad.cpu()

    def check_linked(self, received: Any) -> None:
        """Fail the step at once where a value passed on from the stage before lost its
        autograd link: no gradient would come back, and that stage would wait for one
        until the watchdog ended the job."""
        lost = batch_values.unlinked(received)
        if lost is not None:
            raise RuntimeError(
                f"a {lost} passed on to this stage arrived without its autograd link (torch's"
                " RPC carries a tensor's link only where it sees the tensor itself), so no"
                " gradient could go back to the stage before: pass plain tensors or tensor"
                " subclasses in tuples, lists or dicts, or cut elsewhere (spec.splitPoints)"
            )

    def set_gradient(self, context_id: int, name: str, value: torch.Tensor) -> None:
        """Replace parameter `name`'s gradient this step, where the optimizer reads it."""
        grad = self.gradients(context_id).get(name)
        if grad is None:
            raise RuntimeError(f"{name} has no gradient in this step to combine with its tie")
        grad.copy_(value.to(grad.device))

    # ------------------------------------------------------------------ the model's state

    def state(self) -> dict[str, torch.Tensor]:
        """The shard's parameters and buffers under the model's own names, on the CPU."""
        return {k: v.detach().cpu() for k, v in self.layers.state_dict().items()}

    def write_shard(self, directory: str, filename: str, format: str) -> ShardWritten:
        """Write the shard's state as one file of the model's sharded output, in `directory`
        (which the master sees too); what the index needs of it (runtime/model_files.py)."""
        return model_files.write_shard(directory, filename, self.state(), format)

    def fingerprint(self) -> torch.Tensor:
        """The shard's fingerprint: equal in every replica (replicas must stay identical)."""
        return fingerprint(self.layers)

    def step_optimizer(self, grads: dict[str, torch.Tensor] | None, lr: float | None) -> None:
        """Step the shard's parameters with the step's gradients `grads` (`gradients`; None:
        the parameters' .grad, where `grads_in_place`), with the schedule's learning rate
        `lr` (None: the optimizer's own)."""
        assert self.optimizer is not None, "this stage was built without an optimizer"
        if lr is not None:
            set_lr(self.optimizer, lr)
        params = self.parameters_by_name
        self.optimizer.step(None if grads is None else {params[n]: g for n, g in grads.items()})
        if self.average is not None:  # spec.ema: after every applied step
            self.average.update()

    def keep_average(self, settings: Ema) -> None:
        """Keep spec.ema's average of the shard's parameters from now (runtime/ema.py)."""
        self.average = ema.Average(settings, self.layers.parameters())

    def swap_average(self) -> None:
        """Exchange the parameters and their average: evaluations and the output of it."""
        assert self.average is not None, "this stage keeps no average (spec.ema)"
        self.average.swap()

    def norm(
        self, context_id: int, unscale: float = 1.0, leave_out: frozenset[str] = frozenset()
    ) -> float:
        """The L2 norm of this step's gradients, after dividing them by fp16's loss scale
        (gradients.unscaled_norm): what the master judges and clips the step by."""
        return gradients.unscaled_norm(self.gradients(context_id), unscale, leave_out)

    def finish_step(
        self, context_id: int, coefficient: float, lr: float | None, apply: bool, zero: bool
    ) -> None:
        """The step's tail in one call: where it is applied (`apply`), its gradients scaled
        by the clipping `coefficient` and the optimizer stepped with `lr`
        (`step_optimizer`); with `zero`, .grad forgotten (stepped or skipped)."""
        if apply:
            grads = self.gradients(context_id)
            gradients.scale(grads, coefficient)
            self.step_optimizer(None if self.grads_in_place else grads, lr)
        if zero:
            assert self.optimizer is not None, "this stage was built without an optimizer"
            self.optimizer.zero_grad()

    def save(self, directory: str, name: str) -> FileEntry:
        """Checkpoint this shard and its optimizer's state; the manifest entry."""
        return checkpoint.save_module(directory, name, self.layers, self._optimizers())

    def load(self, directory: str, entries: list[FileEntry], seed: int | None) -> None:
        """Load this shard's state and its optimizer's from the checkpoint files `entries`
        (those that hold its names, written by shards cut anywhere, by either engine). `seed`
        None: the files are the one this very shard wrote, whose RNG state continues (dropout
        masks as they would have been); else the shard is new and its RNG starts from `seed`."""
        parts = state_by_name.load_named(directory, entries, self.layers, self._optimizers())
        if seed is None:
            checkpoint.set_rng_state(parts[0]["rng"])
        else:
            torch.manual_seed(seed)

    def _optimizers(self) -> dict[str, Functional | ema.Average]:
        """The optimizers a checkpoint keeps with the shard, by key (spec.ema's average as
        one: its state is by parameter too)."""
        kept: dict[str, Functional | ema.Average] = {}
        if self.optimizer is not None:
            kept["optimizer"] = self.optimizer
        if self.average is not None:
            kept[ema.CHECKPOINT_KEY] = self.average
        return kept
