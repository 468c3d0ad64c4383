"""The user's code, by import path: "package.module:function" called with the spec's `args`.

Failures name the spec field that gave the path, so the pod's termination message says what
to fix: a module or attribute that does not import is an ImportError (a permanent failure,
ImportFailed); a factory that raises on its arguments is a ValueError naming the args. And
the job's modules imported before a process joins the RPC world (`preload`)."""

from __future__ import annotations

import contextlib
import importlib
from typing import TYPE_CHECKING, Any

from torch import nn

from pipejob.trainer.runtime.json_values import JsonObject
from pipejob.trainer.workloads.refusals import to_users_frame

if TYPE_CHECKING:
    from pipejob.core.common_spec import CommonSpec


def resolve(path: str, field: str) -> Any:
    """The object `path` names; `field` is the spec field that named it (spec.model.import)."""
    module_name, _, attribute = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as e:  # a syntax error or a failing import inside the user's module, too
        raise ImportError(
            f"{field}: cannot import {module_name!r} (from {path!r}): {type(e).__name__}: {e}"
        ) from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ImportError(
                f"{field}: module {module_name!r} has no {attribute!r} (from {path!r})"
            ) from None
    if not callable(target):
        raise ImportError(f"{field}: {path!r} is a {type(target).__name__}, not a function")
    return target


def call(path: str, field: str, args: JsonObject, /, **given: object) -> Any:
    """`path`'s function called with `given` (what pipejob passes, e.g. split="train") and
    the spec's `args`; `field` is the spec field that named it."""
    factory = resolve(path, field)
    try:
        return factory(**given, **args)
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
        with_args = f" with args {args}" if args else ""
        # Raised at the user's line: where the failure's one line says it was raised.
        said = ValueError(f"{field}: {path!r}{with_args} raised {raised}")
        raise said.with_traceback(to_users_frame(e)) from e


def module(path: str, field: str, args: JsonObject, /, **given: object) -> nn.Module:
    """`call`'s result, refused unless it is a torch module (what a model factory returns)."""
    built = call(path, field, args, **given)
    if not isinstance(built, nn.Module):
        for_stage = f" for stage {given['stage']}" if "stage" in given else ""
        raise ValueError(
            f"{field}: {path!r} returned a {type(built).__name__}{for_stage}, not a torch.nn.Module"
        )
    return built


def preload(spec: CommonSpec) -> None:
    """Import the modules the spec names (spec.model.import, spec.data.import,
    spec.loss.import), and so the libraries they import, before this process serves calls:
    arguments arrive on RPC threads, several at once, and unpickling a library's type (MONAI's
    MetaTensor) imports that library there while another thread imports it too; a library
    whose modules import each other (MONAI's do) then fails to import in both. A module that
    does not import is left to the build, which names the field."""
    for owner in ("model", "data", "loss"):
        path = getattr(getattr(spec, owner, None), "import_", None)
        if path:
            with contextlib.suppress(Exception):
                importlib.import_module(path.partition(":")[0])
