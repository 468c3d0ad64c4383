"""A trained model out: state dicts written as files a plain process loads (safetensors by
default, or torch's format; one file, or shards with an index in Hugging Face's layout),
with the modules' versions, and a JSON beside them saying what they are; and
`load_state_dict`, which reads a model back from either layout. For `spec.output` and
`pipejob export`, both kinds. The layout: docs/architecture.md, "The model files out"."""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, TypedDict

import torch
from torch import nn

from pipejob.trainer.runtime.json_values import JsonObject

SUFFIX = {"safetensors": ".safetensors", "torch": ".pt"}
INFO = "model.json"
# Where a safetensors header and an index keep the state dict's `_metadata`.
METADATA = "module_metadata"
Metadata = dict[str, dict[str, Any]]  # per module's name ("" the model), e.g. {"version": 2}


class ModelInfoBase(TypedDict):
    """What model.json says of the model beside its format and files: the keys every kind
    writes (each kind adds its own: pipeline/trained_model.py, hybrid/model_writer.py)."""

    kind: str
    job: str
    model: JsonObject  # the spec's model section(s), as the spec writes them
    steps: int


class ShardWritten(TypedDict):
    """What `write_shard` reports of a shard for the index: its file, each name's bytes,
    and the file's bytes."""

    file: str
    sizes: dict[str, int]
    bytes: int


class ShardIndex(TypedDict):
    """A sharded model's index file, in Hugging Face's layout (`write_index`)."""

    metadata: dict[str, int]  # {"total_size": bytes}
    weight_map: dict[str, str]  # each name's file


def module_metadata(model: nn.Module) -> Metadata:
    """The `_metadata` a plain `model.state_dict()` carries. From a build on the meta device
    too (the master's): a module's version is its class's, and nothing is copied."""
    return dict(model.state_dict(keep_vars=True)._metadata)  # type: ignore[attr-defined]


def with_metadata(
    state: dict[str, torch.Tensor], metadata: Metadata | None
) -> dict[str, torch.Tensor]:
    """`state` as `load_state_dict` reads a plain state dict: an OrderedDict whose
    `_metadata` is `metadata` (or `state` itself, where there is none)."""
    if metadata is None:
        return state
    out = OrderedDict(state)
    out._metadata = metadata  # type: ignore[attr-defined]
    return out


def check_format(format: str) -> None:
    if format not in SUFFIX:
        raise ValueError(f"unknown output format {format!r}: one of {', '.join(SUFFIX)}")


def shard_name(index: int, count: int, format: str, stem: str = "model") -> str:
    """Shard `index` (from 1) of `count`, named as Hugging Face names them."""
    return f"{stem}-{index:05d}-of-{count:05d}{SUFFIX[format]}"


def index_name(format: str, stem: str = "model") -> str:
    return f"{stem}{SUFFIX[format]}.index.json"


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """What a state dict takes in a file: each name's tensor (a tied one once per name)."""
    return sum(t.numel() * t.element_size() for t in state.values())


def writable(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state as CPU tensors safetensors (and torch.save, without the rest of a view's
    storage) writes: a tensor that is whole and not yet seen goes as it is, a view, a
    non-contiguous tensor or a second name of one storage as a contiguous copy. No copy of
    the rest: a stage writing its shard holds it once, not twice."""
    out, seen = {}, set()
    for name, value in state.items():
        t = value.detach().cpu()
        storage = t.untyped_storage()
        whole = t.data_ptr() == storage.data_ptr() and t.nbytes == storage.nbytes()
        if not (whole and t.is_contiguous()) or storage.data_ptr() in seen:
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def save(
    path: Path, state: dict[str, torch.Tensor], format: str, metadata: Metadata | None = None
) -> None:
    """One state dict as one file, with the modules' `metadata` where given: written beside
    it and renamed, never a half-written model."""
    check_format(format)
    tensors = writable(state)
    partial = path.with_name(path.name + ".partial")
    if format == "safetensors":
        from safetensors.torch import save_file

        header = {"format": "pt"}  # a header holds strings only
        if metadata is not None:
            header[METADATA] = json.dumps(metadata)
        save_file(tensors, str(partial), metadata=header)
        sort_metadata(partial)
    else:
        torch.save(with_metadata(tensors, metadata), partial)
    os.replace(partial, path)


def sort_metadata(path: Path) -> None:
    """safetensors writes its header's metadata in a hash map's order, which changes from
    process to process: the same model wrote other bytes (issue 57). Rewritten in place with
    the keys sorted, where the header keeps its length (its JSON as safetensors writes it)."""
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        if "__metadata__" not in header:
            return
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= size:  # safetensors pads its header with spaces
            f.seek(8)
            f.write(text + b" " * (size - len(text)))


def write_shard(
    directory: str | Path, filename: str, state: dict[str, torch.Tensor], format: str
) -> ShardWritten:
    """One shard of a sharded model, written by whichever process holds `state`; what the
    index needs of it: the file's name, each name's bytes, and the file's bytes (which the
    master checks, as it sees the file)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / filename
    save(path, state, format)
    sizes = {k: t.numel() * t.element_size() for k, t in state.items()}
    return {"file": filename, "sizes": sizes, "bytes": path.stat().st_size}


def write_info(directory: Path, info: ModelInfoBase, format: str, files: dict[str, str]) -> Path:
    """model.json: `info`, the format and the files (by stem), written last."""
    path = directory / INFO
    path.write_text(
        json.dumps({**info, "format": format, "files": files}, indent=2, default=str) + "\n"
    )
    return path


def write(
    directory: str | Path,
    files: dict[str, dict[str, torch.Tensor]],
    info: ModelInfoBase,
    format: str = "safetensors",
    metadata: Metadata | None = None,
) -> list[Path]:
    """Each state dict of `files` as <name><suffix> in `directory` (with the modules'
    `metadata`, where given), and model.json with `info` and the files' names; the paths
    written (the JSON last)."""
    check_format(format)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, state in files.items():
        path = directory / f"{name}{SUFFIX[format]}"
        save(path, state, format, metadata)
        written.append(path)
    for name in files:
        remove_stale(directory, [p.name for p in written], name)
    names = {name: p.name for name, p in zip(files, written, strict=True)}
    return [*written, write_info(directory, info, format, names)]


def write_index(
    directory: str | Path,
    shards: list[ShardWritten],
    info: ModelInfoBase,
    format: str = "safetensors",
    stem: str = "model",
    metadata: Metadata | None = None,
) -> list[Path]:
    """The index of `shards` (what `write_shard` returned, in order), with the modules'
    `metadata` where given, and model.json. A name several shards hold (a weight tied
    across stages under one name) maps to the first: the weight_map has each name once;
    total_size counts each once."""
    check_format(format)
    directory = Path(directory)
    weight_map: dict[str, str] = {}
    total = 0
    for shard in shards:
        for name, size in shard["sizes"].items():
            if name not in weight_map:
                weight_map[name] = shard["file"]
                total += size
    index = directory / index_name(format, stem)
    body = ShardIndex(metadata={"total_size": total}, weight_map=dict(sorted(weight_map.items())))
    # The modules' metadata beside Hugging Face's keys, which its readers keep to.
    extra = {} if metadata is None else {METADATA: metadata}
    index.write_text(json.dumps({**body, **extra}, indent=2) + "\n")
    names = [s["file"] for s in shards]
    remove_stale(directory, [*names, index.name], stem)
    files = {Path(n).name.removesuffix(SUFFIX[format]): n for n in names} | {"index": index.name}
    return [*(directory / n for n in names), index, write_info(directory, info, format, files)]


def remove_stale(directory: Path, keep: list[str], stem: str = "model") -> None:
    """Remove the model files of an earlier output into the same directory that this one
    did not write (a single file where shards are written now, or shards of another count):
    `from_pretrained` would prefer a stale `model.safetensors` to a new index."""
    ours = re.compile(
        rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?(\.safetensors|\.pt)(\.index\.json)?"
    )
    for path in directory.iterdir():
        if ours.fullmatch(path.name) and path.name not in keep:
            path.unlink()


def load_state_dict(directory: str | Path, stem: str = "model") -> dict[str, torch.Tensor]:
    """The state dict `stem` of an output directory, whichever way it was written: one file
    (`model.safetensors` or `model.pt`) or shards with their index, with the modules'
    `_metadata` where the output holds it. A fresh model from the user's factory loads it
    with `load_state_dict(..., strict=True)`."""
    directory = Path(directory)
    for format in SUFFIX:
        index = directory / index_name(format, stem)
        if index.exists():
            body = json.loads(index.read_text())
            weight_map = body["weight_map"]
            state = {}
            for file in dict.fromkeys(weight_map.values()):  # each shard once, in order
                part = _load(directory / file, format)
                names = [k for k, f in weight_map.items() if f == file]
                if missing := [k for k in names if k not in part]:
                    raise ValueError(
                        f"{directory / file} lacks {', '.join(missing[:5])},"
                        f" which {index.name} says it holds"
                    )
                state |= {k: part[k] for k in names}
            return with_metadata(state, body.get(METADATA))
        single = directory / f"{stem}{SUFFIX[format]}"
        if single.exists():
            return _load(single, format)
    raise FileNotFoundError(
        f"{directory} holds no {stem}.safetensors, {stem}.pt or index of their shards"
    )


def _load(path: Path, format: str) -> dict[str, torch.Tensor]:
    if format == "safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(path, "pt") as f:
            header = f.metadata() or {}
        found = json.loads(header[METADATA]) if METADATA in header else None
        return with_metadata(load_file(path), found)
    return torch.load(path, weights_only=True)  # a torch file keeps its own `_metadata`
