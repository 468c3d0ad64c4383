"""Label and field selectors, as the apiserver applies them to lists and watches."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

# A label selector requirement: `k`, `!k`, `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a)`.
_REQUIREMENT = re.compile(
    r"\s*(?:(?P<absent>!)\s*(?P<akey>[^\s,!=()]+)"
    r"|(?P<key>[^\s,!=()]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[^\s,!=()]*)"
    r"|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?)\s*(?:,|$)"
)

Predicate = Callable[[Mapping[str, Any]], bool]


class SelectorError(ValueError):
    pass


def _requirements(text: str | None) -> Iterator[re.Match[str]]:
    """A label selector's requirements, parsed one by one."""
    pos, text = 0, (text or "").strip()
    while pos < len(text):
        m = _REQUIREMENT.match(text, pos)
        if not m or m.end() == pos:
            raise SelectorError(f"unable to parse requirement: {text[pos:]!r}")
        pos = m.end()
        yield m


def label_selector(text: str | None) -> Predicate:
    """A predicate over an object's labels; an empty selector matches everything."""
    checks: list[Callable[[Mapping[str, str]], bool]] = []
    for m in _requirements(text):
        if m["absent"]:
            checks.append(lambda labels, k=m["akey"]: k not in labels)
        elif m["op"] in ("=", "=="):
            checks.append(lambda labels, k=m["key"], v=m["value"]: labels.get(k) == v)
        elif m["op"] == "!=":
            checks.append(lambda labels, k=m["key"], v=m["value"]: labels.get(k) != v)
        elif m["setop"]:
            values = {v.strip() for v in m["values"].split(",")}
            if m["setop"] == "in":
                checks.append(lambda labels, k=m["key"], vs=values: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=m["key"], vs=values: labels.get(k) not in vs)
        else:
            checks.append(lambda labels, k=m["key"]: k in labels)

    def matches(obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(check(labels) for check in checks)

    return matches


def required_values(text: str | None) -> dict[str, set[str]]:
    """The values a selector allows for each label it pins (`k=v`, `k==v`, `k in (a,b)`): an
    object outside them cannot match, so a store indexed by label reads only those."""
    pinned: dict[str, set[str]] = {}
    for m in _requirements(text):
        if m["op"] in ("=", "=="):
            values = {m["value"]}
        elif m["setop"] == "in":
            values = {v.strip() for v in m["values"].split(",")}
        else:
            continue
        pinned[m["key"]] = pinned.get(m["key"], values) & values
    return pinned


def field_selector(text: str | None) -> Predicate:
    """A predicate over dotted field paths: `metadata.name=x,status.phase!=Failed`."""
    checks: list[Predicate] = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        m = re.fullmatch(r"([\w.]+)\s*(==|=|!=)\s*(.*)", part)
        if not m:
            raise SelectorError(f"unable to parse field requirement: {part!r}")
        path, op, value = m.groups()
        equal = op != "!="
        checks.append(lambda obj, p=path, v=value, eq=equal: (_field(obj, p) == v) == eq)
    return lambda obj: all(check(obj) for check in checks)


def _field(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for key in path.split("."):
        value = value.get(key) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


def selects(selector: Mapping[str, str] | None, obj: Mapping[str, Any]) -> bool:
    """A Service's equality-based `spec.selector` against an object's labels."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector object (matchLabels, matchExpressions) against labels; the empty one
    matches everything, as in a NetworkPolicy or a Deployment."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], set(e.get("values") or ())
        held = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }
        if op not in held:
            raise SelectorError(f"unknown selector operator {op!r}")
        if not held[op]:
            return False
    return True
