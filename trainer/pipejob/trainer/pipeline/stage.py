"""The stage side of a PipelineJob: a shard of the model on a stage worker, called by the
master over RPC; it computes micro-batches in order and times its forwards and backwards.

Stage workers only serve: they join the RPC world and wait in `rpc.shutdown()` until the
master is done. Each process computes with the threads it was started with (OMP_NUM_THREADS,
which runtime/tuning.py sets per role before torch loads)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.utils.checkpoint
from torch import nn
from torch.distributed.rpc import RRef

from pipejob.trainer.pipeline.parts import Part
from pipejob.trainer.pipeline.reader import Reader, Source
from pipejob.trainer.pipeline.timing import Clock, input_nodes, step_seconds
from pipejob.trainer.runtime import checkpoint, nonfinite, output, rendezvous, tuning
from pipejob.trainer.workloads.cut import join, tensors
from pipejob.trainer.workloads.metrics import Tally


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
    """One shard of the model, held by a stage worker and called by the master over RPC;
    built here from a `Part` (the job's model), or given as a module.

    A shard takes the values live where its stage begins (a tuple: one tensor or several)
    and returns those live where it ends; the last keeps the model's output for the loss or
    the evaluation's figures. The first stage's inputs are the rounds its `reader` read. It
    records when it computes, forward and backward, per micro-batch, and keeps per-step
    totals, so the master can report per-stage time and the pipeline's bubble."""

    def __init__(self, module: nn.Module | Part, last: bool, device: str,
                 precision: str = "fp32", recompute: bool = False,
                 source: Source | None = None):  # fmt: skip
        self.device = torch.device(device)
        self.reader = Reader(source, self.device)  # reads only on a first stage
        if isinstance(module, Part):  # built here: only this stage's parameters exist
            module = module.build()[0]
        self.layers = module.to(self.device)
        self.last = last
        # spec.precision: autocast's dtype (None: float32); the weights stay float32.
        self.autocast = AUTOCAST[precision]
        self.recompute = recompute  # spec.activationCheckpointing
        # One forward at a time, in micro-batch order: micro-batches would otherwise fight
        # over the same cores and race on BatchNorm's running statistics.
        self._order = Turnstile(rendezvous.RPC_TIMEOUT_SECONDS)
        self._record = threading.Lock()
        # [start, end] of "forward" and "backward" per (step, micro-batch) of open steps,
        # folded into per-step totals once a later step starts.
        self._events: dict[tuple[int, Any], dict[str, list[Any]]] = defaultdict(dict)
        self._clock = Clock(self.device)
        self._totals: dict[int, tuple[float, float, float]] = {}
        # Micro-batches whose backward has run through this shard, per step (`settle`).
        self._settled = threading.Condition()
        self._done: dict[int, int] = {}
        # The last stage's outputs per (round, micro-batch), until their loss or tally.
        self._outputs: dict[tuple[int, int], Any] = {}
        # Per training round of the last step: whether every output was finite, per
        # micro-batch (tensors, read only when the master asks: `nonfinite`).
        self._finite: dict[int, list[torch.Tensor]] = {}
        self._finite_step = -1

    def __getstate__(self) -> dict[str, Any]:
        """What pickling a Stage gives: the tensors it holds. An RPC agent with CUDA devices
        pickles every RRef's value to find its tensors, whose streams it synchronises before
        the value is used (torch._jit_internal._extract_tensors); locks, threads and a
        user's module need not pickle for that. A Stage is never sent anywhere."""
        return {"tensors": [*self.layers.parameters(), *self.layers.buffers()]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise TypeError("a Stage cannot be unpickled: it lives on its stage worker")

    def parameter_rrefs(self) -> list[RRef]:
        return [RRef(p) for p in self.layers.parameters()]

    def forward(self, x: tuple[Any, ...] | RRef | None, round: int, micro_batch: int,
                step: int | None) -> Any:  # fmt: skip
        """Micro-batch `micro_batch` of forward round `round` (the turnstile's order); a
        training step's (`step`, timed, with autograd) or, with `step` None, an
        evaluation's (no autograd, the shard in eval mode). `x`: the previous stage's
        output (an RRef), or None on the first stage (the round its reader read)."""
        failed = None
        try:  # fetching waits for no turn: later inputs arrive while this stage computes
            if x is None:
                x = self.reader.input(round, micro_batch)
            elif not isinstance(x, tuple):
                x = x.to_here()  # an RRef, fetched from the previous stage, straight to this one
            received = x
            x = tuple(v.to(self.device) if isinstance(v, torch.Tensor) else v for v in x)
        except Exception as e:
            failed = e
        with self._order.turn(round, micro_batch):
            if failed is not None:
                raise failed
            if step is None:
                y = self._evaluate(x)
            else:
                start = self._clock.mark()
                y = self._compute(x)
                end = self._clock.mark()
        if step is not None:
            with self._record:
                self._fold(before=step)
                # By round too: with gradientAccumulation a step runs several rounds.
                self._events[step, (round, micro_batch)]["forward"] = [start, end]
                if step != self._finite_step:
                    self._finite, self._finite_step = {}, step
                self._finite.setdefault(round, []).append(nonfinite.all_finite(y, quick=True))
            self._time_backward((step, (round, micro_batch)), y, received)
        if self.last:  # kept for `loss` or `tally`: the model's output never leaves the stage
            with self._record:
                self._outputs[round, micro_batch] = y
            return None
        return y

    def _round_outputs(self, round: int, micro_batches: int, labels: RRef) -> tuple[Any, Any]:
        """The last stage: forward round `round`'s outputs, its micro-batches' joined, and
        its labels, fetched from the first stage."""
        with self._record:
            outputs = [self._outputs.pop((round, mb)) for mb in range(micro_batches)]
            # A round that failed half-way leaves outputs no loss will take.
            self._outputs = {k: v for k, v in self._outputs.items() if k[0] > round}
        return join(outputs), labels.to_here().to(self.device)

    def loss(self, round: int, micro_batches: int, labels: RRef,
             loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """The last stage: the loss of training round `round` (the mean over the whole
        batch, as in one process). The master starts the distributed backward from it: a
        scalar crosses to the master, not the outputs."""
        return loss_fn(*self._round_outputs(round, micro_batches, labels)).cpu()

    def tally(self, round: int, micro_batches: int, labels: RRef, loss_fn: Callable[..., Any],
              tally: Tally) -> Tally:  # fmt: skip
        """The last stage: `tally` with evaluation round `round`'s figures added."""
        tally.add(*self._round_outputs(round, micro_batches, labels), loss_fn)
        return tally

    def nonfinite(self, rounds: list[int]) -> bool:
        """Whether any of this stage's outputs in training rounds `rounds` (of the last
        step) was not finite."""
        with self._record:
            flags = [f for r in rounds for f in self._finite.get(r, [])]
        return not all(bool(f) for f in flags)

    def _compute(self, x: tuple[Any, ...], recompute: bool | None = None) -> Any:
        """The shard's forward in the job's precision; with activation checkpointing only
        the inputs are kept and the backward recomputes the rest (torch.utils.checkpoint,
        non-reentrant: its backward runs inside the distributed autograd engine's, where a
        reentrant one would put the gradients outside the step's context). The last stage
        hands float32 to the loss."""
        recompute = self.recompute if recompute is None else recompute
        with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16,
                            enabled=self.autocast is not None):  # fmt: skip
            if recompute:
                y = torch.utils.checkpoint.checkpoint(self.layers, *x, use_reentrant=False)
            else:
                y = self.layers(*x)
        return _float32(y) if self.last and self.autocast is not None else y

    def _evaluate(self, x: tuple[Any, ...]) -> Any:
        self.layers.eval()
        try:
            with torch.no_grad():
                y = self._compute(x, recompute=False)
        finally:
            self.layers.train()
        return y

    def _time_backward(self, key: tuple[int, int], y: Any, received: tuple[Any, ...]):
        """Backward through this shard starts when the gradient of its outputs arrives and
        ends when the autograd nodes nearest the shard's inputs have run; it is done once
        those and the nodes that send the gradient on to the previous stage have run."""
        roots = [t.grad_fn for t in tensors(y) if t.grad_fn is not None]
        if not roots:
            self._backward_done(key)  # nothing of this micro-batch to backpropagate here
            return
        stops = {t.grad_fn for t in tensors(received) if t.grad_fn is not None}
        for root in roots:
            root.register_prehook(lambda grads: self._note(key, "start"))
        ends = input_nodes(roots, stops)
        left = [len(ends) + len(stops)]

        def ran(node_end: bool) -> None:
            if node_end:
                self._note(key, "end")
            with self._settled:
                left[0] -= 1
                if left[0] == 0:
                    self._backward_done(key)

        for node in ends:
            node.register_hook(lambda grads_in, grads_out: ran(True))
        for node in stops:
            node.register_hook(lambda grads_in, grads_out: ran(False))

    def _backward_done(self, key: tuple[int, int]) -> None:
        with self._settled:
            self._done[key[0]] = self._done.get(key[0], 0) + 1
            self._settled.notify_all()

    def settle(self, step: int, micro_batches: int) -> None:
        """Wait until every micro-batch of `step` has backpropagated through this shard.

        The master's distributed backward can return before that: when several gradients of
        one context reach a worker, torch waits only for the RPCs the first one started, so
        the gradient a later one sends on may still be on its way (and a context released
        then loses it). The master settles every stage before the optimizer steps."""
        with self._settled:
            if not self._settled.wait_for(lambda: self._done.get(step, 0) >= micro_batches,
                                          rendezvous.RPC_TIMEOUT_SECONDS):  # fmt: skip
                raise TimeoutError(
                    f"{self._done.get(step, 0)} of {micro_batches} micro-batches of step"
                    f" {step} backpropagated within {rendezvous.RPC_TIMEOUT_SECONDS:g}s"
                )
            self._done = {s: n for s, n in self._done.items() if s > step}

    def _note(self, key: tuple[int, int], what: str) -> None:
        mark = self._clock.mark()
        with self._record:
            self._events[key].setdefault(what, []).append(mark)

    def _fold(self, before: float) -> None:
        for step in sorted({s for s, _ in self._events if s < before}):
            events = [self._events.pop(k) for k in list(self._events) if k[0] == step]
            self._totals[step] = step_seconds(self._intervals(events))

    def _intervals(self, events: list[dict[str, list[Any]]]) -> list[dict[str, list[float]]]:
        """A step's marks as [start, end] seconds of each micro-batch's forward and backward
        (which starts at its last "start" note, or its first "end" one, and ends at its
        last "end" note)."""
        marks = [m for e in events for what in ("forward", "start", "end") for m in e.get(what, [])]
        at = dict(zip(map(id, marks), self._clock.seconds(marks), strict=True))
        intervals = []
        for e in events:
            times = {
                what: [at[id(m)] for m in e.get(what, [])] for what in ("forward", "start", "end")
            }
            interval = {"forward": times["forward"]} if times["forward"] else {}
            notes = times["start"][-1:] or times["end"][:1]
            if notes:
                interval["backward"] = [notes[0], max([notes[0], *times["end"]])]
            intervals.append(interval)
        return intervals

    def timings(self) -> dict[int, tuple[float, float, float]]:
        """Per step: seconds this stage spent in forward, in backward, and busy at all."""
        with self._record:
            self._fold(before=float("inf"))
            return dict(self._totals)

    def average_gradients(self, context_id: int) -> float:
        """With replicas: average this shard's gradients of a step with those of the same
        stage of every other replica (this process's collective group), in place in the
        dist-autograd context, where the optimizer's step reads them. Returns the seconds
        the all-reduce took."""
        import torch.distributed as dist

        start = time.perf_counter()
        grads = dist_autograd.get_gradients(context_id)
        # Every replica holds the same shard, so the same parameters have gradients.
        tensors = [grads[p] for p in self.layers.parameters() if p in grads]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for t, averaged in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(averaged.view_as(t))
        return time.perf_counter() - start

    def gradient(self, context_id: int, name: str) -> torch.Tensor:
        """Parameter `name`'s gradient in a step's dist-autograd context, on the CPU (zero
        when this step gave it none)."""
        p = self.layers.get_parameter(name)
        grad = dist_autograd.get_gradients(context_id).get(p)
        return torch.zeros_like(p, device="cpu") if grad is None else grad.cpu()

    def set_gradient(self, context_id: int, name: str, value: torch.Tensor) -> None:
        """Replace parameter `name`'s gradient in the context, where the optimizer reads it."""
        p = self.layers.get_parameter(name)
        grad = dist_autograd.get_gradients(context_id).get(p)
        if grad is None:
            raise RuntimeError(f"{name} has no gradient in this step to combine with its tie")
        grad.copy_(value.to(grad.device))

    def state(self) -> dict[str, torch.Tensor]:
        """The shard's parameters and buffers under the model's own names, on the CPU."""
        return {k: v.detach().cpu() for k, v in self.layers.state_dict().items()}

    def write_shard(self, directory: str, filename: str, format: str) -> dict[str, Any]:
        """Write the shard's state as one file of the model's sharded output, in `directory`
        (which the master sees too); what the index needs of it (runtime/output.py)."""
        return output.write_shard(directory, filename, self.state(), format)

    def fingerprint(self) -> torch.Tensor:
        """Per parameter, its sum and sum of squares in float64: equal in every replica whose
        shard is the same (replicas must stay identical)."""
        rows = [(p.detach().double().sum(), p.detach().double().square().sum())
                for p in self.layers.parameters()]  # fmt: skip
        return torch.tensor([[a.item(), b.item()] for a, b in rows], dtype=torch.float64)

    def save(self, optimizer: RRef | None, directory: str, name: str) -> dict[str, Any]:
        """Checkpoint this shard and its local optimizer's state; the manifest entry."""
        optimizers = {} if optimizer is None else {"optimizer": optimizer.local_value()}
        return checkpoint.save_module(directory, name, self.layers, optimizers)

    def load(self, optimizer: RRef | None, directory: str, entry: dict[str, Any]) -> None:
        optimizers = {} if optimizer is None else {"optimizer": optimizer.local_value()}
        state = checkpoint.load_module(directory, entry, self.layers, optimizers)
        checkpoint.set_rng_state(state["rng"])  # e.g. dropout masks continue as they would


AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _float32(value: Any) -> Any:
    """Floating tensors of an output (a tensor, a tuple or list, a dict) as float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        return type(value)(_float32(v) for v in value)
    if isinstance(value, dict):
        return type(value)(**{k: _float32(v) for k, v in value.items()})  # a ModelOutput too
    return value


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


def on_stage(stage: RRef, method: str, *args: Any) -> Any:
    """Runs on the stage's worker: call a method of the Stage object held there."""
    return getattr(stage.local_value(), method)(*args)


def on_reader(stage: RRef, method: str, *args: Any) -> Any:
    """Runs on a first stage's worker: call a method of its Reader (the rounds' data)."""
    return getattr(stage.local_value().reader, method)(*args)
