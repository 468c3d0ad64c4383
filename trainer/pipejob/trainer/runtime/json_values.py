"""JSON values where the shape is the user's or the spec's (a spec's model section, the
arguments of a user's factory): the types a JSON value has, not `Any`."""

from __future__ import annotations

JsonValue = None | bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"]
JsonObject = dict[str, JsonValue]
