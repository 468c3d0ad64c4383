"""A small declarative schema: one table per job kind drives defaulting, validation
(with field paths) and the CRD's OpenAPI schema, so the model and the CRDs cannot drift."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from pipejob.core import k8s
from pipejob.core.errors import SpecError, shown


@dataclass(frozen=True)
class Field:
    """One field of a spec. `type` is an OpenAPI type: integer, number, string, boolean,
    object or array; or int-or-string (Kubernetes' x-kubernetes-int-or-string), whose
    minimum and maximum bound its integers and whose pattern its strings, as in OpenAPI; or
    string-or-object: a shortcut string (checked by enum and pattern) or an object (checked
    by fields and rules); or int-or-object: an integer (checked by minimum and maximum) or
    an object (checked by fields and rules). No structural schema can say "string or
    object" or "integer or object", so the CRD keeps such a field unchecked
    (x-kubernetes-preserve-unknown-fields) and only the Python validation (`parse`:
    `pipejob validate`, `run` and the operator) checks it, in full."""

    type: str
    description: str
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    enum: tuple[Any, ...] | None = None
    pattern: str | None = None
    pattern_says: str | None = None  # what `pattern` asks for, in words, for error messages
    max_length: int | None = None
    fields: dict[str, Field] | None = None  # object with known properties
    values: Field | None = None  # object used as a map: every value has this schema
    items: Field | None = None  # array items
    free_form: bool = False  # an object passed through unchecked
    # A Kubernetes type whose generated schema (core/k8s.py) checks it and goes in the CRD.
    k8s: str | None = None
    max_items: int | None = None
    min_items: int | None = None
    # A list whose entries are told apart by these keys (x-kubernetes-list-type: map).
    list_map_keys: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    rules: tuple[Rule, ...] = ()
    # An opt-in section (checkpoint, profile): absent unless written; its defaults apply
    # only inside it. Other objects with defaults are filled in even when left out.
    section: bool = False


@dataclass(frozen=True)
class Rule:
    """A cross-field rule, written once as CEL (enforced by the API server) and once as
    Python (enforced by `pipejob run` and the operator) over the same defaulted object."""

    cel: str
    message: str
    path: str  # the field the rule is about, relative to the object it sits on ("": itself)
    check: Callable[[dict[str, Any]], bool] = field(compare=False)
    # A message that names the object's own values (a count it needs), once as a CEL string
    # expression (the CRD's messageExpression) and once as Python; `message` stays the
    # fallback the API server shows if the expression fails.
    message_expression: str | None = None
    explain: Callable[[dict[str, Any]], str] | None = field(default=None, compare=False)

    def reason(self, obj: dict[str, Any]) -> str:
        """The message of a broken rule about `obj`, as the Python side says it."""
        return self.explain(obj) if self.explain is not None else self.message


def integer(description: str, default: int | None = None, minimum: int | None = 0, **kw) -> Field:
    """An integer field, by default at least 0."""
    return Field("integer", description, default=default, minimum=minimum, **kw)


def integer_list(description: str, item: str, default: list[int], max_items: int) -> Field:
    """A list field of integers, each at least 1 (`item` says what one is)."""
    items = integer(item, minimum=1)
    return Field("array", description, items=items, default=default, max_items=max_items)


_TYPE_NAMES = {
    **k8s.TYPE_NAMES,
    "int-or-string": "an integer or a string",
    "string-or-object": "a string or a mapping",
    "int-or-object": "an integer or a mapping",
}


def _has_type(kind: str, value: Any) -> bool:
    if kind == "int-or-string":
        return k8s.is_type("integer", value) or isinstance(value, str)
    if kind == "string-or-object":
        return isinstance(value, str | dict)
    if kind == "int-or-object":
        return k8s.is_type("integer", value) or isinstance(value, dict)
    if kind in k8s.TYPE_NAMES:
        return k8s.is_type(kind, value)
    raise ValueError(f"unknown schema type {kind}")


# How many known names an unknown field's message suggests.
MAX_SUGGESTIONS = 3
# An enum this long or shorter is listed whole in a message; a longer one by its nearest names.
MAX_LISTED = 8

# Kubernetes stores integers as int64: anything larger cannot reach the API server.
INT64_MAX = 2**63 - 1


def apply(schema: Field, value: Any, path: str, errors: list[SpecError]) -> Any:
    """Return `value` with defaults filled in; append every problem found to `errors`."""
    if schema.k8s is not None:
        k8s.check(k8s.schema(schema.k8s), value, path, errors)
        return value
    if not _has_type(schema.type, value):
        errors.append(SpecError(path, f"must be {_TYPE_NAMES[schema.type]}, got {shown(value)}"))
        return value
    if schema.type in ("int-or-string", "string-or-object", "int-or-object"):
        return _apply_either(schema, value, path, errors)
    if schema.type == "number":
        # float(10**400) raises: such an integer is as good as infinite here
        value = math.inf if isinstance(value, int) and abs(value) > 10**308 else float(value)
        if not math.isfinite(value):
            errors.append(SpecError(path, f"must be a finite number, got {shown(value)}"))
            return value
    if schema.type == "integer" and abs(value) > INT64_MAX:
        errors.append(
            SpecError(path, f"must fit in 64 bits (at most {INT64_MAX}), got {shown(value)}")
        )
        return value
    errors += _value_errors(schema, value, path)
    if schema.type == "array" and schema.items is not None:
        value = [apply(schema.items, v, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if schema.list_map_keys:
        k8s.unique_by(value, schema.list_map_keys, path, errors)
    if schema.type == "object" and not schema.free_form:
        value = _apply_object(schema, value, path, errors)
    return value


def _apply_either(schema: Field, value: Any, path: str, errors: list[SpecError]) -> Any:
    """A value of an either-or type, applied as the form it has: the shortcut (a string or
    an integer, which enum, pattern, minimum and maximum are about) or the object."""
    if schema.type == "int-or-string":
        return _int_or_string(schema, value, path, errors)
    if schema.type == "string-or-object":
        if isinstance(value, str):
            as_string = replace(schema, type="string", fields=None, rules=(), required=())
            return apply(as_string, value, path, errors)
        as_object = replace(schema, type="object", enum=None, pattern=None, max_length=None)
        return _apply_object(as_object, value, path, errors)
    if isinstance(value, int):  # int-or-object
        as_integer = replace(schema, type="integer", fields=None, rules=(), required=())
        return apply(as_integer, value, path, errors)
    as_object = replace(schema, type="object", minimum=None, maximum=None)
    return _apply_object(as_object, value, path, errors)


def _value_errors(schema: Field, value: Any, path: str) -> list[SpecError]:
    """What a value of the right type breaks: enum, bounds, pattern, length and item count."""
    errors = []
    if schema.enum is not None and value not in schema.enum:
        errors.append(SpecError(path, _not_a_member(schema.enum, value)))
    if schema.minimum is not None:
        if schema.exclusive_minimum and value <= schema.minimum:
            errors.append(
                SpecError(path, f"must be > {_number_text(schema.minimum)}, got {shown(value)}")
            )
        elif value < schema.minimum:
            errors.append(
                SpecError(path, f"must be >= {_number_text(schema.minimum)}, got {shown(value)}")
            )
    if schema.maximum is not None:
        if schema.exclusive_maximum and value >= schema.maximum:
            errors.append(
                SpecError(path, f"must be < {_number_text(schema.maximum)}, got {shown(value)}")
            )
        elif value > schema.maximum:
            errors.append(
                SpecError(path, f"must be <= {_number_text(schema.maximum)}, got {shown(value)}")
            )
    if schema.pattern is not None and not re.fullmatch(schema.pattern, value):
        wanted = schema.pattern_says or f"match {schema.pattern}"
        errors.append(SpecError(path, f"must {wanted}, got {shown(value)}"))
    if schema.max_length is not None and len(value) > schema.max_length:
        errors.append(SpecError(path, f"must be at most {schema.max_length} characters"))
    if schema.max_items is not None and len(value) > schema.max_items:
        errors.append(SpecError(path, f"must hold at most {schema.max_items} items"))
    if schema.min_items is not None and len(value) < schema.min_items:
        errors.append(
            SpecError(path, f"must hold at least {schema.min_items} item(s), got {len(value)}")
        )
    return errors


def _not_a_member(enum: tuple[Any, ...], value: Any) -> str:
    """A value outside a short enum: every member; outside a long one: the nearest three."""
    if len(enum) <= MAX_LISTED:
        return f"must be one of {', '.join(str(c) for c in enum)}; got {shown(value)}"
    return f"must be one of its {len(enum)} names, got {shown(value)}{_closest_names(value, enum)}"


def _number_text(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _int_or_string(schema: Field, value: int | str, path: str, errors: list[SpecError]) -> Any:
    """An integer is checked as an integer field; a string against the pattern, and the
    message says both forms are allowed."""
    if isinstance(value, int):
        return apply(replace(schema, type="integer", pattern=None), value, path, errors)
    if schema.pattern is not None and not re.fullmatch(schema.pattern, value):
        hint = " (an integer is written without quotes)" if value.strip().isdigit() else ""
        errors.append(
            SpecError(
                path,
                f"must be an integer or a string matching {schema.pattern},"
                f" got {shown(value)}{hint}",
            )
        )
    return value


def _apply_object(schema: Field, value: dict, path: str, errors: list[SpecError]) -> dict:
    if schema.values is not None:
        return {k: apply(schema.values, v, f"{path}.{k}", errors) for k, v in value.items()}
    known = schema.fields or {}
    out: dict[str, Any] = {}
    for key in value:
        if key not in known:
            hint = _closest_names(key, known)
            errors.append(SpecError(f"{path}.{key}", "unknown field" + hint))
    for key, sub in known.items():
        if key in value and value[key] is not None:
            out[key] = apply(sub, value[key], f"{path}.{key}", errors)
        elif sub.default is not None:
            out[key] = apply(sub, _copied(sub.default), f"{path}.{key}", errors)
        elif _filled_in(sub):
            out[key] = _apply_object(sub, {}, f"{path}.{key}", errors)
        elif key in schema.required:
            errors.append(SpecError(f"{path}.{key}", "is required"))
    if not errors_under(errors, path):
        for rule in schema.rules:
            if not rule.check(out):
                where = f"{path}.{rule.path}" if rule.path else path
                errors.append(SpecError(where, rule.reason(out)))
    return out


def errors_under(errors: list[SpecError], path: str) -> bool:
    return any(e.path == path or e.path.startswith(path + ".") for e in errors)


def _filled_in(schema: Field) -> bool:
    """An object left out that still gets its defaults (as `{}` with defaults inside)."""
    return (
        schema.type == "object"
        and not schema.section
        and any(f.default is not None or _filled_in(f) for f in (schema.fields or {}).values())
    )


def _copied(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


def _closest_names(key: Any, known: Iterable[Any]) -> str:
    """The nearest known names (at most three, compared without case), not the whole list."""
    import difflib

    lowered = {str(name).lower(): str(name) for name in known}
    matches = difflib.get_close_matches(str(key)[:100].lower(), list(lowered), n=MAX_SUGGESTIONS)
    if not matches:
        return " (none known is close; `kubectl explain` or docs/api-reference.md lists them)"
    names = [repr(lowered[m]) for m in matches]
    said = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return f" (did you mean {said}?)"


def openapi(schema: Field) -> dict[str, Any]:
    """The OpenAPI v3 (structural) schema of a field, as a CRD wants it."""
    if schema.k8s is not None:
        return {"description": schema.description, **copy.deepcopy(k8s.schema(schema.k8s))}
    if schema.type in ("string-or-object", "int-or-object"):
        # Structural schemas have no "string or object": the API server keeps it as written
        # (its default aside); parse checks it.
        # kubectl explain and the API reference see no properties here: say them in words.
        text = f"{schema.description} As an object: {_in_words(schema)}"
        out = {"description": text, "x-kubernetes-preserve-unknown-fields": True}
        return out | ({"default": schema.default} if schema.default is not None else {})
    out: dict[str, Any] = {"type": schema.type, "description": schema.description}
    if schema.type == "int-or-string":  # no type: either, as a structural schema says it
        del out["type"]
        out["x-kubernetes-int-or-string"] = True
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.default is not None:
        out["default"] = schema.default
    elif _filled_in(schema):
        out["default"] = {}  # the API server then fills nested defaults in, as `apply` does
    if schema.minimum is not None:
        num = schema.minimum if schema.type == "number" else int(schema.minimum)
        out["minimum"] = num
        if schema.exclusive_minimum:
            out["exclusiveMinimum"] = True
    if schema.maximum is not None:
        out["maximum"] = schema.maximum if schema.type == "number" else int(schema.maximum)
        if schema.exclusive_maximum:
            out["exclusiveMaximum"] = True
    if schema.enum is not None:
        out["enum"] = list(schema.enum)
    if schema.pattern is not None:
        out["pattern"] = f"^{schema.pattern}$"
    if schema.max_length is not None:
        out["maxLength"] = schema.max_length
    if schema.max_items is not None:
        out["maxItems"] = schema.max_items
    if schema.min_items is not None:
        out["minItems"] = schema.min_items
    if schema.items is not None:
        out["items"] = openapi(schema.items)
    if schema.list_map_keys:
        out["x-kubernetes-list-type"] = "map"
        out["x-kubernetes-list-map-keys"] = list(schema.list_map_keys)
    if schema.free_form:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if schema.values is not None:
        out["additionalProperties"] = openapi(schema.values)
    if schema.fields:
        out["properties"] = {k: openapi(v) for k, v in schema.fields.items()}
    if schema.required:
        out["required"] = list(schema.required)
    if schema.rules:
        out["x-kubernetes-validations"] = [_crd_validation(r) for r in schema.rules]
    return out


def _crd_validation(rule: Rule) -> dict[str, Any]:
    out = {"rule": rule.cel, "message": rule.message}
    if rule.path:
        out["fieldPath"] = f".{rule.path}"
    if rule.message_expression is not None:
        out["messageExpression"] = rule.message_expression
    return out


def _in_words(schema: Field) -> str:
    """The fields and rules of an object table as one sentence."""
    parts = []
    for name, sub in (schema.fields or {}).items():
        facts = ["object" if sub.free_form else sub.type]
        if sub.default is not None:
            facts.append(f"default {sub.default}")
        if sub.minimum is not None:
            facts.append(f">= {_number_text(sub.minimum)}")
        if sub.pattern_says:
            facts.append(sub.pattern_says.removeprefix("be "))
        if sub.fields:
            facts = [f"an object with {_in_words(sub).rstrip('.')}"]
        parts.append(f"{name} ({', '.join(facts)})")
    rules = "".join(f" {r.message[0].upper()}{r.message[1:]}." for r in schema.rules)
    return "; ".join(parts) + "." + rules
