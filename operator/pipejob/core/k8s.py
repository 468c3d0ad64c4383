"""The Kubernetes objects a pod template passes through (env, resources, volumes, ...): their
structural schemas, generated from a pinned Kubernetes OpenAPI into k8s_schemas.json by
scripts/k8s-schemas.py, and a checker for the subset of OpenAPI those schemas use.

The CRDs embed the same schemas, so `kubectl apply` and `pipejob validate` refuse the same
mistakes. Objects with known properties are closed here, as kubectl's strict field
validation makes them: an unknown key is an error, not silently dropped."""

from __future__ import annotations

import difflib
import json
import math
import re
from decimal import Decimal, InvalidOperation
from functools import cache
from pathlib import Path
from typing import Any

from pipejob.core.errors import SpecError, shown

SCHEMAS = Path(__file__).with_name("k8s_schemas.json")


@cache
def schemas() -> dict[str, Any]:
    return json.loads(SCHEMAS.read_text())


def schema(name: str) -> dict[str, Any]:
    """The structural schema of a Kubernetes type, e.g. "Volume"."""
    return schemas()[name]


# An OpenAPI type as a message names it (schema.py adds pipejob's own either-or types).
TYPE_NAMES = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
    "object": "a mapping",
    "array": "a list",
}


def is_type(kind: str, value: Any) -> bool:
    """Whether `value` is of OpenAPI type `kind` (a bool is no integer or number)."""
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "boolean": bool, "object": dict, "array": list}[kind])


def check(s: dict[str, Any], value: Any, path: str, errors: list[SpecError]) -> None:
    """Append to `errors` every way `value` breaks schema `s`, each with its field path."""
    if s.get("x-kubernetes-int-or-string"):
        if not (is_type("integer", value) or isinstance(value, str)):
            hint = (
                ' (write a fraction as a string, e.g. "0.5" or 500m)'
                if isinstance(value, float)
                else ""
            )
            errors.append(
                SpecError(path, f"must be an integer or a string, got {shown(value)}{hint}")
            )
        elif isinstance(value, str) and "pattern" in s and not re.search(s["pattern"], value):
            errors.append(SpecError(path, f"is not a Kubernetes quantity: {shown(value)}"))
        return
    kind = s.get("type")
    if kind is not None and not is_type(kind, value):
        errors.append(SpecError(path, f"must be {TYPE_NAMES[kind]}, got {shown(value)}"))
        return
    if isinstance(value, float) and not math.isfinite(value):
        errors.append(SpecError(path, f"must be a finite number, got {shown(value)}"))
    if "enum" in s and value not in s["enum"]:
        errors.append(SpecError(path, f"must be one of {', '.join(s['enum'])}; got {shown(value)}"))
    if isinstance(value, str):
        if "pattern" in s and not re.search(s["pattern"], value):
            errors.append(SpecError(path, f"must match {s['pattern']}, got {shown(value)}"))
        if "maxLength" in s and len(value) > s["maxLength"]:
            errors.append(SpecError(path, f"must be at most {s['maxLength']} characters"))
    if isinstance(value, dict):
        _object(s, value, path, errors)
    if isinstance(value, list):
        _array(s, value, path, errors)


def _object(s: dict[str, Any], value: dict, path: str, errors: list[SpecError]) -> None:
    if s.get("x-kubernetes-preserve-unknown-fields"):
        return
    if "additionalProperties" in s:
        for key, item in value.items():
            check(s["additionalProperties"], item, f"{path}.{key}", errors)
        return
    known = s.get("properties", {})
    for key, item in value.items():
        if key not in known:
            match = difflib.get_close_matches(key, list(known), n=1)
            hint = f" (did you mean {match[0]!r}?)" if match else ""
            errors.append(SpecError(f"{path}.{key}", "unknown field" + hint))
        elif item is not None:  # null is "not set", as the API server reads it
            check(known[key], item, f"{path}.{key}", errors)
    for key in s.get("required", []):
        if value.get(key) is None:
            errors.append(SpecError(f"{path}.{key}", "is required"))


def _array(s: dict[str, Any], value: list, path: str, errors: list[SpecError]) -> None:
    for i, item in enumerate(value):
        check(s.get("items", {}), item, f"{path}[{i}]", errors)
    unique_by(value, tuple(s.get("x-kubernetes-list-map-keys", ())), path, errors)


def unique_by(items: list, keys: tuple[str, ...], path: str, errors: list[SpecError]) -> None:
    """A list-map's entries must differ in their keys (two volumes with one name)."""
    if not keys:
        return
    first: dict[tuple, int] = {}
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        key = tuple(json.dumps(item.get(k)) for k in keys)
        if key in first:
            what = ", ".join(f"{k} {item.get(k)!r}" for k in keys)
            why = f"duplicate {what} (also {path}[{first[key]}])"
            errors.append(SpecError(f"{path}[{i}]", why))
        else:
            first[key] = i


_SUFFIXES = {
    "": 1,
    "m": Decimal("0.001"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("500m", "32Gi", 2, "1e3") as a number."""
    text = str(value).strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if suffix and text.endswith(suffix):
            number, factor = text[: -len(suffix)], _SUFFIXES[suffix]
            break
    else:
        number, factor = text, 1
    try:
        return Decimal(number) * factor
    except InvalidOperation:
        raise ValueError(f"not a Kubernetes quantity: {shown(value)}") from None
