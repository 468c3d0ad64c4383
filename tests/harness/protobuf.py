"""Kubernetes' protobuf encoding of request bodies, read into the JSON objects they stand for,
for the kinds a client sends that way to this emulator: Secrets and ConfigMaps (helm stores
each release in one, and client-go sends built-in kinds as protobuf, with no JSON fallback).

The envelope is `k8s\\x00` + runtime.Unknown{typeMeta{apiVersion, kind}, raw}; raw is the
object's message (field numbers from k8s.io/api/core/v1/generated.proto and
k8s.io/apimachinery/pkg/apis/meta/v1/generated.proto). Fields the API server sets
(creationTimestamp, managedFields, ...) are skipped; an unknown kind is a ValueError."""

from __future__ import annotations

import base64
from collections.abc import Iterator

MAGIC = b"k8s\x00"
Wire = tuple[int, int | bytes]  # (field number, value)


def decode(body: bytes) -> dict:
    """The JSON object of a protobuf request body (ValueError when it is not one we read)."""
    if not body.startswith(MAGIC):
        raise ValueError("not a Kubernetes protobuf body (no k8s\\0 prefix)")
    envelope = dict(_fields(body[len(MAGIC) :]))
    type_meta = {n: v.decode() for n, v in _fields(envelope.get(1, b""))}
    api_version, kind = type_meta.get(1, ""), type_meta.get(2, "")
    read = {("v1", "Secret"): _secret, ("v1", "ConfigMap"): _config_map}.get((api_version, kind))
    if read is None:
        raise ValueError(f"protobuf bodies of {api_version} {kind} are not read here")
    return {"apiVersion": api_version, "kind": kind, **read(envelope.get(2, b""))}


def _secret(raw: bytes) -> dict:
    obj: dict = {}
    for number, value in _fields(raw):
        if number == 1:
            obj["metadata"] = _meta(value)
        elif number == 2:
            key, data = _entry(value)
            obj.setdefault("data", {})[key.decode()] = base64.b64encode(data).decode()
        elif number == 3:
            obj["type"] = value.decode()
        elif number == 4:
            key, data = _entry(value)
            obj.setdefault("stringData", {})[key.decode()] = data.decode()
        elif number == 5:
            obj["immutable"] = bool(value)
    return obj


def _config_map(raw: bytes) -> dict:
    obj: dict = {}
    for number, value in _fields(raw):
        if number == 1:
            obj["metadata"] = _meta(value)
        elif number in (2, 3):
            key, data = _entry(value)
            text = data.decode() if number == 2 else base64.b64encode(data).decode()
            obj.setdefault("data" if number == 2 else "binaryData", {})[key.decode()] = text
        elif number == 4:
            obj["immutable"] = bool(value)
    return obj


def _meta(raw: bytes) -> dict:
    strings = {1: "name", 2: "generateName", 3: "namespace", 5: "uid", 6: "resourceVersion"}
    meta: dict = {}
    for number, value in _fields(raw):
        if number in strings and value:
            meta[strings[number]] = value.decode()
        elif number in (11, 12):
            key, text = _entry(value)
            meta.setdefault("labels" if number == 11 else "annotations", {})[key.decode()] = (
                text.decode()
            )
        elif number == 14:
            meta.setdefault("finalizers", []).append(value.decode())
        elif number == 13:
            raise ValueError("protobuf ownerReferences are not read here")
    return meta


def _entry(raw: bytes) -> tuple[bytes, bytes]:
    """A map entry: key (1) and value (2)."""
    fields = dict(_fields(raw))
    return fields.get(1, b""), fields.get(2, b"")


def _fields(buf: bytes) -> Iterator[Wire]:
    """The fields of a protobuf message in order: varints as ints, the rest as bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i : i + size], i + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, i = buf[i : i + size], i + size
        else:
            raise ValueError(f"protobuf wire type {wire} is not read here")
        yield number, value


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated protobuf varint")
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not byte & 0x80:
            return value, i
