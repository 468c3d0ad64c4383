"""What tracing a model, or running a stage of it, must leave as it was: a Hugging Face
model's key/value cache is off meanwhile (`without_cache`), and a forward traced has its
modules' state, attributes and the lists and dicts they hold put back after it (`unchanged`);
`holds_traced` tells a traced value anywhere in a container; `read_from_python_state` where
a trace fixed a value a forward writes at run time. Used by the tracer
(workloads/tracing.py), the cut (workloads/cut.py) and a stage's piece (workloads/piece.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn


def holds_traced(value: Any) -> bool:
    """Whether a value holds a traced value (a Proxy) anywhere in its containers."""
    if isinstance(value, fx.Proxy):
        return True
    if isinstance(value, tuple | list | set | frozenset):
        return any(holds_traced(v) for v in value)
    if isinstance(value, dict):
        return any(holds_traced(v) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # As stored: a config's own attribute code may raise (Gemma 4's per-layer ones).
        stored = getattr(value, "__dict__", {})
        return any(holds_traced(stored.get(f.name)) for f in dataclasses.fields(value))
    return False


@contextmanager
def without_cache(model: nn.Module, configs: list[Any] | None = None) -> Iterator[None]:
    """A Hugging Face model traced, or a stage run, with its key/value cache off
    (`config.use_cache`, of `configs` when given: `cache_configs(model)`'s): training needs
    none, and the cache object cannot be passed between stages."""
    configs = cache_configs(model) if configs is None else configs
    before = [c.use_cache for c in configs]
    for c in configs:
        c.use_cache = False
    try:
        yield
    finally:
        for c, value in zip(configs, before, strict=True):
            c.use_cache = value


@contextmanager
def unchanged(model: nn.Module, flags: dict[nn.Module, str] | None = None) -> Iterator[None]:
    """A forward traced without changing the model: a forward that assigns to its modules
    (CTRL's `self.pos_encoding = self.pos_encoding.to(...)`) would leave a traced value in
    them, which the next trace, or the stages, would read. Its parameters, buffers, modules
    and attributes are put back as they were; attributes fx adds (its constants) stay. A
    scripted module (`torch.jit.script`) is run, never changed, by a trace: left alone.
    `flags` gets each module whose plain settings (a str, int, float or bool) the forward
    changed, and which (BigBird's `attention_type`, switched by the sequence's length)."""
    modules = [m for m in model.modules() if not isinstance(m, torch.jit.ScriptModule)]
    kept = [(m, {k: dict(getattr(m, k)) for k in _STATE}, dict(vars(m))) for m in modules]
    # A forward that writes into a list or dict it holds (DynUNet's deep-supervision heads)
    # would leave traced values in it for the next trace: their contents are put back too.
    held = [(c, list(c) if isinstance(c, list) else dict(c)) for c in python_containers(model)]
    try:
        yield
    finally:
        for container, contents in held:
            if _changed(container, contents):
                WRITTEN[id(container)] = container
            if isinstance(container, list):
                container[:] = contents
            else:
                container.clear()
                container.update(contents)
        for module, state, attributes in kept:
            for key, values in state.items():
                getattr(module, key).clear()
                getattr(module, key).update(values)
            for key in [k for k in vars(module) if k not in attributes]:
                if holds_traced(vars(module)[key]):
                    del vars(module)[key]
            for key, value in attributes.items():
                if key not in _STATE:
                    now = vars(module).get(key)
                    # Plain settings only: a config's __eq__ reads attributes that may raise.
                    plain = isinstance(value, str | int | float)
                    same = now is value or (plain and type(now) is type(value) and now == value)
                    if flags is not None and plain and not same:
                        flags.setdefault(module, f"{key}: {value!r} -> {now!r}")
                    vars(module)[key] = value


_STATE = ("_parameters", "_buffers", "_modules")
# The lists and dicts of a module that a traced forward wrote into, by id (and held, so the
# id stays theirs): a constant read from one is a value the forward writes as it runs.
WRITTEN: dict[int, list[Any] | dict[Any, Any]] = {}


def _changed(container: list[Any] | dict[Any, Any], contents: list[Any] | dict[Any, Any]) -> bool:
    if isinstance(container, list):
        return len(container) != len(contents) or any(
            a is not b for a, b in zip(container, contents, strict=False)
        )
    return container.keys() != contents.keys() or any(  # type: ignore[union-attr]
        container[k] is not contents[k] for k in container
    )


def python_containers(model: nn.Module) -> Iterator[list[Any] | dict[Any, Any]]:
    """The lists and dicts of tensors a model's modules hold as plain attributes (not
    parameters, buffers or modules): Python state a forward may write and another read."""
    for module in model.modules():
        for key, value in vars(module).items():
            if key not in _STATE and isinstance(value, list | dict) and value:
                items = value if isinstance(value, list) else list(value.values())
                if any(isinstance(v, torch.Tensor | fx.Proxy) for v in items):
                    yield value


def read_from_python_state(graph: fx.Graph, model: nn.Module) -> str | None:
    """Where a graph reads, as a constant, a tensor a module holds in a list or dict of its
    attributes that a traced forward wrote into (what a forward writes there at run time,
    the trace has fixed): `heads[0] of skip_layers`; None where it reads none. A list of
    constants (torchvision's anchors) is read as one."""
    for node in graph.nodes:
        if node.op != "get_attr" or not str(node.target).startswith("_tensor_constant"):
            continue
        value = getattr(model, str(node.target), None)
        for path, module in model.named_modules():
            for key, held in vars(module).items():
                if key in _STATE or id(held) not in WRITTEN:  # a list of constants is none
                    continue
                found = held.items() if isinstance(held, dict) else enumerate(held)
                for index, item in found:
                    if item is value:
                        return f"{key}[{index!r}] of {path or 'the model'}"
    return None


def cache_configs(model: nn.Module) -> list[Any]:
    """The Hugging Face configs of a model's modules that say whether to keep a cache."""
    configs = {
        id(c): c for m in model.modules() if hasattr(c := getattr(m, "config", None), "use_cache")
    }
    return list(configs.values())
