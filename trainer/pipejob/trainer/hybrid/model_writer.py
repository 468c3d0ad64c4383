"""A HybridJob's trained model as files anyone can load: what spec.output writes at the end
of a run and `pipejob export` from a complete checkpoint, through one `write`. The tables
come in chunks of about CHUNK_BYTES from the servers or their checkpoint files, so no
process holds a table whole. The files and how to load them: docs/user-guide.md, "The
trained model"."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, NotRequired, TypedDict, cast

import torch
import torch.distributed.rpc as rpc

from pipejob.core.kinds.hybrid import ONE_TABLE, HybridSpec
from pipejob.core.kinds.tables import Shard
from pipejob.trainer.hybrid import ps
from pipejob.trainer.hybrid.records import Evaluation, FileEntry, HybridSummary, SavedServer
from pipejob.trainer.hybrid.replicated import FILE as REPLICATED
from pipejob.trainer.runtime import checkpoint, model_files

# Summary fields that describe the trained model (model.json's "metrics").
METRICS = (
    "firstLoss",
    "finalLoss",
    "evalLoss",
    "evalAccuracy",
    "evalAuc",
    "evalSamples",
    "evalStep",
)
CHUNK_BYTES = 64 << 20
Rows = Callable[[str, int, int], torch.Tensor]  # rows start..stop-1 of a table


class TableSection(TypedDict):
    """A table of spec.embeddings, in the model's spec."""

    name: str
    rows: int
    dim: int
    mode: str
    feature: str


class OneTableSection(TypedDict):
    """spec.embedding's one table, in the model's spec."""

    numEmbeddings: int
    dim: int
    mode: str


class DlrmSection(TypedDict):
    """The built-in DLRM's hidden widths."""

    bottom: list[int]
    top: list[int]


# The dense part: the built-in DLRM's widths, or the user's module ("import", a Python word)
# and its args; with spec.embedding, its outFeatures first.
DenseSection = TypedDict(
    "DenseSection",
    {"outFeatures": int, "dlrm": DlrmSection, "import": str, "args": dict[str, Any]},
    total=False,
)


class ModelSpec(TypedDict):
    """The spec's model sections (the manifest's and model.json's "model"): the tables
    (spec.embeddings) or the one table (spec.embedding), and the dense part."""

    embeddings: NotRequired[list[TableSection]]
    embedding: NotRequired[OneTableSection]
    dense: DenseSection


class Metrics(TypedDict, total=False):
    """The figures of the trained model that the run has (model.json's and the manifest's
    "metrics"), in METRICS' order."""

    firstLoss: float
    finalLoss: float
    evalLoss: float
    evalAccuracy: float
    evalAuc: float
    evalSamples: int
    evalStep: int


class HybridModelInfo(TypedDict):
    """model.json, less the format and the files' names (model_files.write_info adds them):
    the run's kind, job, model and metrics, its steps, and the checkpoint it came from
    (`pipejob export`)."""

    kind: str | None
    job: str | None
    model: ModelSpec
    metrics: Metrics
    steps: int
    checkpoint: NotRequired[str]


class HybridManifest(TypedDict):
    """A HybridJob checkpoint's manifest.json as read (runtime/checkpoint.py writes its
    first keys; board.write_manifest the rest): an older pipejob's may lack some."""

    format: int
    step: int
    time: float
    files: list[FileEntry]
    index: dict[str, str]
    kind: NotRequired[str]
    job: NotRequired[str]
    trainerCount: NotRequired[int]
    parameterServers: NotRequired[int]
    model: ModelSpec
    metrics: NotRequired[Metrics]


def model_spec(spec: HybridSpec) -> ModelSpec:
    """The spec's model sections, as in the manifest: what a reader needs to rebuild it."""
    dense = spec.dense
    section = DenseSection()
    if dense.import_ is not None:
        section = DenseSection({"import": dense.import_, "args": dense.args})
    if spec.embedding is not None:
        one = spec.embedding
        return ModelSpec(
            embedding=OneTableSection(numEmbeddings=one.num_embeddings, dim=one.dim, mode=one.mode),
            dense=DenseSection(outFeatures=dense.out_features, **section),
        )
    if dense.import_ is None:
        section = DenseSection(
            dlrm=DlrmSection(bottom=list(dense.dlrm.bottom), top=list(dense.dlrm.top))
        )
    tables = [
        TableSection(name=t.name, rows=t.rows, dim=t.dim, mode=t.mode, feature=t.feature)
        for t in spec.embeddings
    ]
    return ModelSpec(embeddings=tables, dense=section)


def metrics(figures: HybridSummary | Evaluation | None) -> Metrics:
    """The figures among METRICS that `figures` (a run's summary, or its latest evaluation)
    has, not None."""
    if figures is None:
        return Metrics()
    found = {k: figures[k] for k in METRICS if figures.get(k) is not None}
    return cast(Metrics, found)


def server_entries(manifest: HybridManifest) -> list[FileEntry]:
    """The manifest's entries of the servers' files (ps<i>.pt): the tables' shards."""
    return [e for e in manifest["files"] if e["name"].startswith("ps")]


def rows_from_shards(
    shards: list[tuple[str, int, int, int, Callable[[int, int], torch.Tensor]]],
) -> Rows:
    """Rows of a table from its shards, (table, start, stop, first column, fetch(start,
    stop) in table rows), whichever shards a range spans: rows joined, then columns."""

    def rows(table: str, start: int, stop: int) -> torch.Tensor:
        mine = sorted((p for p in shards if p[0] == table), key=lambda p: (p[3], p[1]))
        columns = []
        for column in sorted({p[3] for p in mine}):
            parts = [
                fetch(max(start, lo), min(stop, hi))
                for _, lo, hi, first, fetch in mine
                if first == column and max(start, lo) < min(stop, hi)
            ]
            columns.append(torch.cat(parts) if len(parts) > 1 else parts[0])
        return torch.cat(columns, dim=1) if len(columns) > 1 else columns[0]

    return rows


def live_rows(
    servers: list[str], placement: list[list[Shard]], held: dict[str, torch.Tensor]
) -> Rows:
    """The tables' rows from the servers holding them (on the master, after training), and
    from `held`, the replicated tables (a trainer's)."""

    def fetch(server: str, k: int, shard: Shard) -> Callable[[int, int], torch.Tensor]:
        def rows(lo: int, hi: int) -> torch.Tensor:
            return rpc.rpc_sync(server, ps.rows, args=(k, lo - shard.start, hi - shard.start))

        return rows

    def copy(weight: torch.Tensor) -> Callable[[int, int], torch.Tensor]:
        return lambda lo, hi: weight[lo:hi]

    return rows_from_shards(
        [
            (p.table, p.start, p.stop, p.column, fetch(server, k, p))
            for server, shards in zip(servers, placement, strict=True)
            for k, p in enumerate(shards)
        ]
        + [(name, 0, len(weight), 0, copy(weight)) for name, weight in held.items()]
    )


def saved_rows(directory: str | Path, manifest: HybridManifest) -> Rows:
    """The tables' rows from a checkpoint's server files, mapped (each checked against the
    manifest first), and its replicated tables."""
    shards = []
    for entry in server_entries(manifest):
        checkpoint.load_part(directory, entry)  # checks its size and checksum
        state: SavedServer = torch.load(
            Path(directory) / entry["name"], mmap=True, weights_only=True
        )
        for q in state["pieces"]:
            fetch = lambda lo, hi, q=q: q["weight"][lo - q["start"] : hi - q["start"]]  # noqa: E731
            shards.append((q["table"], q["start"], q["stop"], q.get("column", 0), fetch))
    for entry in manifest["files"]:  # the replicated tables, whole (replicated.py)
        if entry["name"] == REPLICATED:
            held = checkpoint.load_part(directory, entry)["model"]
            for key, weight in held.items():
                fetch = lambda lo, hi, w=weight: w[lo:hi]  # noqa: E731
                shards.append((key.removesuffix(".weight"), 0, len(weight), 0, fetch))
    return rows_from_shards(shards)


def write(
    model: ModelSpec,
    out: str | Path,
    format: str,
    rows: Rows,
    dense: dict[str, torch.Tensor],
    meta: HybridModelInfo,
) -> list[Path]:
    """Write the files of `model` (a `model_spec`) and model.json (`meta` plus the format and
    the file names) into the directory `out`; the paths written. spec.embeddings: one file,
    `model`, every table whole under `tables.<name>.weight` and the dense part under
    `dense.<name>` (workloads.recsys.Recommender's state_dict); spec.embedding: `table` (key
    `weight`) and `dense`, each a state_dict."""
    model_files.check_format(format)
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    if "embedding" in model:
        one = model["embedding"]
        tables = {ONE_TABLE: (one["numEmbeddings"], one["dim"])}
        files = {"table": ({"weight": ONE_TABLE}, {}), "dense": ({}, dense)}
    else:
        tables = {t["name"]: (t["rows"], t["dim"]) for t in model["embeddings"]}
        files = {
            "model": (
                {f"tables.{name}.weight": name for name in tables},
                {f"dense.{k}": v for k, v in dense.items()},
            )
        }
    paths = []
    for stem, (streamed, whole) in files.items():
        path = directory / f"{stem}{model_files.SUFFIX[format]}"
        partial = path.with_name(path.name + ".partial")
        if format == "safetensors":
            shapes = {key: tables[name] for key, name in streamed.items()}
            dtypes = {key: rows(name, 0, 1).dtype for key, name in streamed.items()}
            chunks = {key: _chunks(rows, name, *shapes[key]) for key, name in streamed.items()}
            with open(partial, "wb") as f:
                _stream(f, shapes, dtypes, whole, chunks)
        else:
            state = {key: rows(name, 0, tables[name][0]) for key, name in streamed.items()}
            torch.save(model_files.writable({**state, **whole}), partial)
        os.replace(partial, path)
        paths.append(path)
    for stem in files:
        model_files.remove_stale(directory, [p.name for p in paths], stem)
    names = {stem: p.name for stem, p in zip(files, paths, strict=True)}
    return [*paths, model_files.write_info(directory, meta, format, names)]


def _chunks(rows: Rows, table: str, count: int, dim: int) -> Iterator[torch.Tensor]:
    step = max(1, CHUNK_BYTES // (dim * 4))
    for start in range(0, count, step):
        yield rows(table, start, min(start + step, count))


# safetensors' names of torch's dtypes.
_DTYPES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _stream(
    f: BinaryIO,
    shapes: dict[str, tuple[int, int]],
    dtypes: dict[str, torch.dtype],
    whole: dict[str, torch.Tensor],
    chunks: dict[str, Iterator[torch.Tensor]],
) -> None:
    """A safetensors file: the tensors of `whole` and, under the keys of `shapes` (and
    `dtypes`), tables written chunk by chunk as `chunks[key]` gives them; in name order."""
    kinds = {k: (dtypes[k], shape) for k, shape in shapes.items()}
    kinds |= {k: (v.dtype, tuple(v.shape)) for k, v in whole.items()}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in sorted(kinds):
        dtype, shape = kinds[key]
        size = dtype.itemsize
        for n in shape:
            size *= n
        header[key] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(text)) + text)
    for key in sorted(kinds):
        parts = chunks[key] if key in shapes else [whole[key]]
        for part in parts:
            f.write(memoryview(part.detach().cpu().contiguous().view(torch.uint8).numpy()))


def export_checkpoint(
    directory: str | Path, manifest: HybridManifest, out: str | Path, format: str = "safetensors"
) -> list[Path]:
    """The output files from a complete HybridJob checkpoint: `directory` is its step
    directory and `manifest` its manifest.json (as read); the tables come from the servers'
    files, the dense module from dense.pt (each checked against the manifest)."""
    entries = {e["name"]: e for e in manifest["files"]}
    if "dense.pt" not in entries or not server_entries(manifest):
        raise checkpoint.CheckpointError(
            f"{directory}: the manifest lists no dense.pt or no ps<i>.pt; not a complete"
            " checkpoint of a job with embedding tables"
        )
    dense = checkpoint.load_part(directory, entries["dense.pt"])["model"]
    meta = HybridModelInfo(
        kind=manifest.get("kind"),
        job=manifest.get("job"),
        model=manifest["model"],
        metrics=manifest.get("metrics", Metrics()),
        steps=manifest["step"],
        checkpoint=str(directory),
    )
    return write(manifest["model"], out, format, saved_rows(directory, manifest), dense, meta)
