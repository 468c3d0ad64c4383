"""Server-side table printing (`Accept: application/json;as=Table`), which `kubectl get` asks for.

Columns come from a CRD's `additionalPrinterColumns`; everything else gets Name and Age."""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from typing import Any

NAME = {
    "name": "Name",
    "type": "string",
    "format": "name",
    "priority": 0,
    "description": "Name must be unique within a namespace.",
}
AGE = {
    "name": "Age",
    "type": "date",
    "jsonPath": ".metadata.creationTimestamp",
    "priority": 0,
    "description": "CreationTimestamp of the object.",
}


def wants_table(accept: str | None) -> bool:
    return "as=Table" in (accept or "")


def table(
    objects: list[Mapping[str, Any]], columns: list[Mapping[str, Any]] | None, resource_version: str
) -> dict[str, Any]:
    columns = list(columns or [AGE])
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": [NAME]
        + [
            {
                "name": c["name"],
                "type": c.get("type", "string"),
                "format": c.get("format", ""),
                "description": c.get("description", ""),
                "priority": c.get("priority", 0),
            }
            for c in columns
        ],
        "rows": [
            {
                "cells": [obj["metadata"]["name"]] + [_cell(obj, c) for c in columns],
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": obj["metadata"],
                },
            }
            for obj in objects
        ],
    }


def _cell(obj: Mapping[str, Any], column: Mapping[str, Any]) -> Any:
    value = jsonpath(obj, column["jsonPath"])
    if value is None:
        return None
    if column.get("type") == "date":
        return age(str(value))
    return value


def jsonpath(obj: Any, path: str) -> Any:
    """The simple JSONPaths printer columns use: `.a.b`, `.a[0].b`; None when absent."""
    for key, index in re.findall(r"\.([^.\[\]]+)|\[(\d+)\]", path):
        if key and isinstance(obj, Mapping):
            obj = obj.get(key)
        elif index and isinstance(obj, list) and int(index) < len(obj):
            obj = obj[int(index)]
        else:
            return None
    return obj


def age(timestamp: str, now: datetime.datetime | None = None) -> str:
    """Like the apiserver's human durations: 42s, 5m, 3h, 2d."""
    then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int(((now or datetime.datetime.now(datetime.UTC)) - then).total_seconds())
    if seconds < 0:
        return "<invalid>"
    for limit, unit, size in ((120, "s", 1), (3 * 3600, "m", 60), (48 * 3600, "h", 3600)):
        if seconds < limit:
            return f"{seconds // size}{unit}"
    return f"{seconds // 86400}d"
