"""One model's conformance check (benchmarks/conformance.py runs it over the zoos): what
pipejob's cut and its per-stage build do to a model nobody here wrote, against a plain build
of the same model under the same seed, in float64, in this one process:

(a) every stage, built the way a stage process builds it (the factory again, keeping only
    the stage's parameters and what they are computed from, then traced and cut again),
    holds parameters and buffers equal, bit for bit, to the plain build's;
(b) the stages, run one after the other on the micro-batches, give the plain model's outputs
    bit for bit, in training mode (both under the same seed: dropout draws alike) and in
    evaluation mode;
(c) one step's gradients, each tied or shared weight's copies summed as the pipeline sums
    them, equal the plain model's (within 1e6 float64 eps of each gradient's scale), the loss
    too;
(d) the model file the output writes from the stages and the state no stage holds loads
    strictly into a fresh build, with the plain build's values and only its persistent
    state, and the modules' versions a plain state dict carries (its `_metadata`).

At up to MAX_STAGES evenly spaced candidates, and in two at the middle one where that is
not one of them. A model pipejob refuses to cut (workloads/cut.py's CutError) is `refused`, with
the refusal's one line, unless the eager path computes it exactly (`eager`: _conform_eager.py);
a model its own library cannot build, or run, here is `not built`;
anything else that differs or raises is `failing`, with what and where."""

from __future__ import annotations

import gc
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _conform_engine import EAGER, auto_engine, said
from torch import nn
from torch.utils._pytree import tree_flatten

from pipejob.trainer.pipeline.shape_check import fits_model
from pipejob.trainer.runtime import model_files, nonfinite
from pipejob.trainer.workloads import cut, materialize
from pipejob.trainer.workloads.cut import CutError, Traced, join, ties, without_cache

# Per dtype, the bound on a gradient's error relative to its scale. float64: as
# tests/jobrun.py's, the algorithm, not rounding. float32, for models whose kernels take no
# float64 (a Mixtral's grouped matmul): the stages add the same terms as the model but a
# tied weight's copies, summed once more; 1000 eps (1.2e-4) is far above that and far below
# any real error (the T5 was off by 0.16 of a gradient of norm 0.22).
TOLERANCE = {
    torch.float64: 1e6 * torch.finfo(torch.float64).eps,
    torch.float32: 1e3 * torch.finfo(torch.float32).eps,
}
MAX_STAGES = 4
SEED = 1234
MICRO_BATCHES = 2


@dataclass
class Row:
    zoo: str
    name: str
    verdict: str  # exact, refused, failing, not built
    why: str = ""
    seconds: float = 0.0
    params: int = 0
    cuts: str = ""  # the stages' first units, per cut
    engine: str = ""  # engine auto's choice for the model (_conform_engine.py)


class Failed(Exception):
    """A check that did not hold: which, and how."""


def run(
    zoo: str,
    name: str,
    factory: Callable[[], nn.Module],
    sample: Callable[[], Any],
    float64: str | None = None,
) -> Row:
    """The verdict on `factory`'s model, fed `sample()` (a batch of MICRO_BATCHES * 2); in
    float32 alone where `float64` says why not in float64 (the memory it would need)."""
    start = time.perf_counter()
    row = Row(zoo, name, "exact")
    default = torch.get_default_dtype()
    in_float64 = float64
    try:
        try:
            for dtype in (torch.float32,) if float64 else (torch.float64, torch.float32):
                torch.set_default_dtype(dtype)
                try:
                    _check(row, _seeded(factory), sample)
                    break
                except _NotBuilt as e:
                    if dtype == torch.float32:
                        raise
                    in_float64 = _line(e.__cause__ or e)
            if dtype == torch.float32:
                row.why = f"in float32: it does not run in float64 ({in_float64})"
            row.engine = _engine(factory, sample)
        except _NotBuilt as e:
            row.verdict, row.why = "not built", _line(e.__cause__ or e)
        except CutError as e:
            row.verdict, row.why = "refused", _line(e)
        except Failed as e:
            row.verdict, row.why = "failing", str(e)
        except Exception as e:
            row.verdict, row.why = "failing", f"raised {_line(e)}"
        if row.verdict == "refused":  # in the dtype the trace refused it in
            # Once the refusal is gone: its traceback's frames hold the plain build (a 167M
            # model is 1.3 GB in float64), which the eager check would hold beside 3 more.
            gc.collect()
            _on_the_eager_path(row, factory, sample)
    finally:
        torch.set_default_dtype(default)
    row.seconds = time.perf_counter() - start
    return row


def _on_the_eager_path(
    row: Row, factory: Callable[[], nn.Module], sample: Callable[[], Any]
) -> None:
    """A refused row tried on the eager path (_conform_eager.py), in the dtype the trace
    refused it in: `eager` where it is exact there; else still refused, saying why."""
    from _conform_eager import check_eager

    try:
        row.cuts = "eager: " + check_eager(_seeded(factory), sample())
        row.verdict, row.why = "eager", f"the trace refused it ({row.why})"
        row.engine = f"rpc: {EAGER}"
    except Failed as e:
        row.why += f"; on the eager path: {e}"
    except Exception as e:
        row.why += f"; on the eager path: raised {_line(e)}"


class _NotBuilt(Exception):
    pass


def _engine(factory: Callable[[], nn.Module], sample: Callable[[], Any]) -> str:
    """auto's engine for an exact row, as the table says it; why not, where it raised."""
    try:
        x = sample()
        first = _micro(x)[0] if isinstance(x, torch.Tensor) else x  # what a stage traces with
        return said(auto_engine(_seeded(factory), first, MAX_STAGES))
    except Exception as e:  # the row's verdict stands; the column says why
        return f"not chosen: {_line(e)}"


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(SEED)
        return factory()

    return build


def _line(error: BaseException) -> str:
    """An error in one line, with the innermost frame outside torch."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/torch/" not in f.filename]
    where = f" (at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno})" if frames else ""
    text = " ".join(str(error).split())[:300]
    return f"{type(error).__name__}: {text}{where}"


def _check(row: Row, build: Callable[[], nn.Module], sample: Callable[[], Any]) -> None:
    try:
        plain = build()
        x = sample()
        with torch.no_grad(), without_cache(plain):
            y = plain.eval()(x)
            plain.train()
        if not bool(nonfinite.all_finite(y)):  # Canine's masks, in float64: nothing to compare
            raise ValueError(f"its outputs are not finite in {torch.get_default_dtype()}")
    except Exception as e:
        raise _NotBuilt() from e
    row.params = sum(p.numel() for p in plain.parameters())
    meta, made = materialize.build(build, ())
    numbered = materialize.numbering(meta, made)
    fits_model(meta, x, torch.zeros(len(x), dtype=torch.long), _generic_loss)
    traced = Traced(meta, want=2 * MAX_STAGES, sample=_sample_of(x))
    units = traced.units
    if len(units) < 2:
        raise cut.cut_count_error(len(units), 2, traced.whole)
    n = min(len(units), MAX_STAGES)
    cuts = [[units[k * len(units) // n] for k in range(1, n)]]
    if units[len(units) // 2] not in cuts[0]:
        cuts.append([units[len(units) // 2]])
    row.cuts = "; ".join(", ".join(c) for c in cuts)
    for starts in cuts:
        _check_cut(build, meta, numbered, starts, x)


def _check_cut(
    build: Callable[[], nn.Module],
    meta: nn.Module,
    numbered: materialize.Numbering,
    starts: list[str],
    x: Any,
) -> None:
    plain = build()  # a forward changes state (batch norm's statistics): a fresh one per cut
    want = 2 * MAX_STAGES
    planned = Traced(meta, want=want, sample=_sample_of(x)).split(starts)
    stages = []
    for k, planned_stage in enumerate(planned):  # as pipeline/stage_build.py's PieceBuilder.build
        keep = materialize.numbers(numbered, cut.state_names(planned_stage))
        with torch.random.fork_rng(devices=[]):
            model, _ = materialize.build(build, keep)
        stages.append(Traced(model, want=want, sample=_sample_of(x)).split(starts)[k])
    where = f"cut at {', '.join(starts)}"
    _same_state(plain, stages, where)
    _same_outputs(plain, stages, x, where)
    _same_gradients(plain, stages, ties(planned), x, where)
    _loads_back(build, plain, meta, numbered, planned, stages, where)


def _sample_of(x: Any) -> torch.Tensor | None:
    """The job's input as a stage traces with its shapes (a micro-batch's)."""
    return _micro(x)[0] if isinstance(x, torch.Tensor) else None


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }


def _same_state(plain: nn.Module, stages: list[nn.Module], where: str) -> None:
    """(a) Each stage's parameters and buffers equal the plain build's, bit for bit."""
    expected = _state(plain)
    for k, stage in enumerate(stages):
        kept = stage.state_dict()
        for name, value in _state(stage).items():
            if name not in expected:
                if name in kept:  # fx's own constants are held, but not as state
                    raise Failed(
                        f"(a) {where}: stage {k}'s state holds {name}, which the model's has not"
                    )
                continue
            if value.device.type == "meta":
                raise Failed(f"(a) {where}: stage {k} did not build {name}")
            if value.dtype != expected[name].dtype or not torch.equal(value, expected[name]):
                raise Failed(
                    f"(a) {where}: stage {k}'s {name} differs from a plain build's"
                    f" ({_difference(value, expected[name])})"
                )


def _difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}"
    if not a.is_floating_point():
        return f"{int((a != b).sum())} of {a.numel()} values"
    return f"largest difference {(a.double() - b.double()).abs().max().item():.3g}"


def _chain(stages: list[nn.Module], x: Any) -> Any:
    values = (x,)
    for stage in stages:
        values = stage(*values)
    return values


def _micro(x: Any) -> list[Any]:
    return list(x.tensor_split(MICRO_BATCHES))


def _outputs(model: nn.Module | list[nn.Module], x: Any, training: bool) -> Any:
    """The joined outputs of the micro-batches, under the same seed (dropout draws alike)."""
    torch.manual_seed(SEED + 1)
    if isinstance(model, list):
        for stage in model:
            stage.train(training)
        return join([_chain(model, part) for part in _micro(x)])
    model.train(training)
    with without_cache(model):
        return join([model(part) for part in _micro(x)])


def _same_outputs(plain: nn.Module, stages: list[nn.Module], x: Any, where: str) -> None:
    """(b) The same outputs, bit for bit, in training mode and in evaluation mode."""
    for training in (True, False):
        mode = "training" if training else "evaluation"
        with torch.no_grad():
            got, expected = _outputs(stages, x, training), _outputs(plain, x, training)
        if type(got) is not type(expected):
            raise Failed(
                f"(b) {where}: in {mode} the stages return a {type(got).__name__},"
                f" the model a {type(expected).__name__}"
            )
        a, b = _leaves(got), _leaves(expected)
        if len(a) != len(b):
            raise Failed(
                f"(b) {where}: in {mode} the stages return {len(a)} tensors, the model {len(b)}"
            )
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            if u.shape != v.shape or not torch.equal(u, v):
                raise Failed(f"(b) {where}: output {i} in {mode} differs ({_difference(u, v)})")


def _leaves(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _generic_loss(outputs: Any, labels: Any = None) -> torch.Tensor:
    """A scalar that depends on every floating output: each one's values weighted by a
    seeded pattern of their shape (so no output's gradient is symmetric or zero)."""
    total = torch.zeros((), dtype=torch.float64, device=_leaves(outputs)[0].device)
    for t in _leaves(outputs):
        if t.is_floating_point() and t.numel():
            g = torch.Generator().manual_seed(t.numel())
            weights = torch.randn(t.shape, generator=g, dtype=torch.float64)
            total = total + (t.double() * weights.to(t.device)).sum() / t.numel()
    return total


def _same_gradients(
    plain: nn.Module, stages: list[nn.Module], tied: list[list[tuple[int, str]]], x: Any, where: str
) -> None:
    """(c) One step's gradients: the stages', tied copies summed, against the model's."""
    for m in (plain, *stages):
        m.zero_grad(set_to_none=True)
    got_loss = _generic_loss(_outputs(stages, x, True))
    got_loss.backward()
    loss = _generic_loss(_outputs(plain, x, True))
    loss.backward()
    bound = TOLERANCE[torch.get_default_dtype()]
    if abs(got_loss.item() - loss.item()) > bound * max(abs(loss.item()), 1e-30):
        raise Failed(f"(c) {where}: the loss is {got_loss.item()!r}, one process's {loss.item()!r}")
    grads: dict[str, torch.Tensor | None] = {}
    for stage in stages:
        grads |= {n: p.grad for n, p in stage.named_parameters(remove_duplicate=False)}
    for group in tied:  # as the pipeline combines them (driver.PipelineBase.combine_tied)
        parts = [stages[k].get_parameter(n).grad for k, n in group]
        present = [g for g in parts if g is not None]
        total = torch.stack(present).sum(0) if present else None
        for k, n in group:
            for name, p in stages[k].named_parameters(remove_duplicate=False):
                if p is stages[k].get_parameter(n):
                    grads[name] = total
    for name, p in plain.named_parameters(remove_duplicate=False):
        expected, got = p.grad, grads.get(name)
        if expected is None or not expected.any():
            if got is not None and got.any():
                raise Failed(f"(c) {where}: {name} got a gradient the model does not give it")
            continue
        if got is None:
            raise Failed(f"(c) {where}: {name} got no gradient in the stages")
        scale = expected.abs().max().item()
        error = (got - expected).abs().max().item()
        if error > bound * scale:
            raise Failed(
                f"(c) {where}: {name}'s gradient is off by {error:.3g} (its scale {scale:.3g})"
            )


def _loads_back(
    build: Callable[[], nn.Module],
    plain: nn.Module,
    meta: nn.Module,
    numbered: materialize.Numbering,
    planned: list[nn.Module],
    stages: list[nn.Module],
    where: str,
) -> None:
    """(d) The output (the stages' states, the rest and the modules' metadata, as
    pipeline/cut_model.py builds them) loads strictly into a fresh build, with the plain
    build's values and module metadata."""
    rest = cut.unused(meta, planned)
    if any(v.device.type == "meta" or k in numbered.buffers for k, v in rest.items()):
        with torch.random.fork_rng(devices=[]):
            whole, _ = materialize.build(build, materialize.numbers(numbered, rest))
        rest = {k: v for k, v in whole.state_dict().items() if k in rest}
    states = [{k: v.detach() for k, v in s.state_dict().items()} for s in stages]
    expected = plain.state_dict()
    with tempfile.TemporaryDirectory() as directory:
        model_files.write(
            directory,
            {"model": {**rest, **{k: v for s in states for k, v in s.items()}}},
            {},
            "safetensors",
            model_files.module_metadata(meta),
        )
        written = model_files.load_state_dict(directory)
    # A fresh build's, which a user loads into: a forward may change a model's modules
    # (BigBird's first swaps its attention's, adding a dropout's entry to the plain one's).
    fresh = build()
    if getattr(written, "_metadata", None) != dict(fresh.state_dict()._metadata):  # type: ignore[attr-defined]
        raise Failed(f"(d) {where}: the output's module metadata is not a plain state dict's")
    if sorted(written) != sorted(expected):
        extra = sorted(set(written) - set(expected))[:3]
        missing = sorted(set(expected) - set(written))[:3]
        raise Failed(
            f"(d) {where}: the output holds {extra} the model's state has not, and lacks {missing}"
        )
    try:
        fresh.load_state_dict(written, strict=True)
    except Exception as e:
        raise Failed(f"(d) {where}: a fresh build does not load the output: {_line(e)}") from None
    for name, value in fresh.state_dict().items():
        if not torch.equal(value, expected[name]):
            raise Failed(f"(d) {where}: {name} loads as {_difference(value, expected[name])}")
