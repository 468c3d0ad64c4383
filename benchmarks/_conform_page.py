"""The conformance page (docs/conformance.md) that benchmarks/conformance.py writes: its rows
as a markdown table with each zoo's counts of verdicts and of the engine `engine: auto`
chooses, and a page read back into rows (so a pass of --engines fills an existing table)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from _common import machine

VERDICTS = ("exact", "eager", "refused", "failing", "not built", "not run")
ENGINE_COLUMN = "auto's engine"  # benchmarks/_conform_engine.py
CHOSEN = ("pipelining", "rpc")  # what the column begins with where auto chose
ZOO_ORDER = [
    "torch",
    "torchvision",
    "timm",
    "transformers",
    "diffusers",
    "peft",
    "open_clip",
    "x_transformers",
    "vit_pytorch",
    "segmentation_models_pytorch",
    "monai",
    "kornia",
    "torchtune",
    "esm",
    "pytorch_tabnet",
]


def render(paths: list[Path]) -> str:
    """The page from files of rows: JSON lines, or a page this script wrote (its table
    read back); a later row of a model replaces an earlier one, and a row of --engines
    only adds its engine to the model's row."""
    import _zoos  # the page says how much of the whole zoo the rows are

    listed = {zoo: set(_zoos.names(zoo)) for zoo in ZOO_ORDER}
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for path in paths:
        lines = path.read_text().splitlines()
        read = rows_of_page(lines) if path.suffix == ".md" else [json.loads(s) for s in lines]
        for row in read:
            # By the zoo's own name: a shown one adds the model built ("coat (coat_tiny)"),
            # which a row that timed out could not learn ("coat").
            name = row["name"]
            key = row["zoo"], name if name in listed[row["zoo"]] else name.split(" (")[0]
            if row["verdict"]:
                rows[key] = row
            elif rows.get(key, {}).get("verdict") in ("exact", "eager"):  # --engines' choice
                rows[key] |= {"engine": row["engine"], "engineCommit": row.get("commit", "?")}
    done = sorted(rows.values(), key=lambda r: (ZOO_ORDER.index(r["zoo"]), r["name"]))
    seconds = sum(r["seconds"] for r in done)
    return table(done, seconds, {zoo: len(listed[zoo]) for zoo in ZOO_ORDER})


def rows_of_page(lines: list[str]) -> list[dict[str, Any]]:
    """The rows of a page `table` wrote, as its rows were (the seconds rounded)."""
    head = next(i for i, line in enumerate(lines) if line.startswith("| zoo | model |"))
    columns = [c.strip() for c in lines[head].strip("|").split("|")]
    rows = []
    for line in lines[head + 2 :]:
        if not line.startswith("| "):
            break
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        got = dict(zip(columns, cells, strict=True))
        rows.append(
            {
                "zoo": got["zoo"],
                "name": got["model"],
                "verdict": got["verdict"],
                "why": got["why"],
                "params": int(got["parameters"].replace(",", "")),
                "cuts": got["cuts (where stages begin)"],
                "seconds": float(got["seconds"]),
                "commit": got["commit"],
                "engine": got.get(ENGINE_COLUMN, ""),
            }
        )
    return rows


def engines(rows: list[dict[str, Any]]) -> str:
    """Per zoo: how many rows `engine: auto` runs on each engine; on none (the job is
    refused, or the row was not built or not run here); and not yet recorded (an exact or
    eager row checked before the harness recorded the choice, or whose choice raised)."""
    lines = [f"{'auto chose':<13}" + "".join(f"{c:>11}" for c in (*CHOSEN, "none", "not yet"))]
    for zoo in [*dict.fromkeys(r["zoo"] for r in rows), "all"]:
        tally = Counter(engine_of(r) for r in rows if zoo in ("all", r["zoo"]))
        lines.append(f"{zoo:<13}" + "".join(f"{tally[c]:>11}" for c in (*CHOSEN, "", "?")))
    return "\n".join(lines)


def recorded(rows: list[dict[str, Any]]) -> str:
    """How many of the rows auto can run have its engine recorded, where not all have."""
    kinds = [engine_of(r) for r in rows if r["verdict"] in ("exact", "eager")]
    if "?" not in kinds:
        return ""
    done = len(kinds) - kinds.count("?")
    return (
        f"; recorded for {done} of the {len(kinds)} exact and eager rows so far (the others:"
        " `python benchmarks/conformance.py --engines --rows ROWS`, then `--render`)"
    )


def engine_of(row: dict[str, Any]) -> str:
    """A row's engine as the tally counts it: pipelining, rpc, "" (none) or "?" (not yet)."""
    engine = row.get("engine", "")
    if engine.startswith(CHOSEN):
        return engine.split(":")[0]
    return "?" if row["verdict"] in ("exact", "eager") else ""


def counts(rows: list[dict[str, Any]], seconds: float) -> str:
    """Per zoo: how many rows of each verdict, and the seconds they took."""
    lines = [f"{'zoo':<13}" + "".join(f"{v:>11}" for v in VERDICTS) + f"{'seconds':>10}"]
    for zoo in dict.fromkeys(r["zoo"] for r in rows):
        mine = [r for r in rows if r["zoo"] == zoo]
        tally = Counter(r["verdict"] for r in mine)
        lines.append(
            f"{zoo:<13}"
            + "".join(f"{tally[v]:>11}" for v in VERDICTS)
            + f"{sum(r['seconds'] for r in mine):>10.0f}"
        )
    tally = Counter(r["verdict"] for r in rows)
    lines.append(
        f"{'all':<13}" + "".join(f"{tally[v]:>11}" for v in VERDICTS) + f"{seconds:>10.0f}"
    )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]], seconds: float, totals: dict[str, int]) -> str:
    """The markdown page: how much of the zoos it covers, the counts, then every row and
    the commit it was checked at."""
    partial = ""
    if len(rows) < sum(totals.values()):
        per_zoo = ", ".join(
            f"{zoo} {sum(r['zoo'] == zoo for r in rows)} of {total}"
            for zoo, total in totals.items()
        )
        partial = f" (partial: {len(rows)} of {sum(totals.values())} rows so far: {per_zoo})"
    commits = sorted({r.get("commit", "?") for r in rows})
    chosen = sorted({r["engineCommit"] for r in rows if r.get("engineCommit")})
    lines = [
        "# Conformance",
        "",
        "Generated by `python benchmarks/conformance.py --table docs/conformance.md`"
        f"{partial}; at pipejob {', '.join(commits)}; {machine()}; {seconds / 60:.0f} minutes"
        " of checking. What each check is:"
        " [benchmarks/_conform.py](../benchmarks/_conform.py); the zoos:"
        " [benchmarks/_zoos.py](../benchmarks/_zoos.py).",
        "",
        "```",
        counts(rows, seconds),
        "```",
        "",
        f"{ENGINE_COLUMN}: the engine a PipelineJob that names none runs the model on (`engine:"
        " auto`), and why where it is rpc, in as many stages as the first cut"
        " ([benchmarks/_conform_engine.py](../benchmarks/_conform_engine.py): the master's"
        " choice from what the model passes into each place to cut; pipejob's default loss"
        " assumed)"
        + (f"; recorded at pipejob {', '.join(chosen)} (`--engines`)" if chosen else "")
        + recorded(rows)
        + ":",
        "",
        "```",
        engines(rows),
        "```",
        "",
        f"| zoo | model | verdict | {ENGINE_COLUMN} | why | parameters | cuts (where stages begin)"
        " | seconds | commit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        # eager's cuts: a | b
        why, cuts, engine = (r.get(k, "").replace("|", "\\|") for k in ("why", "cuts", "engine"))
        lines.append(
            f"| {r['zoo']} | {r['name']} | {r['verdict']} | {engine} | {why} | {r['params']:,} |"
            f" {cuts} | {r['seconds']:.0f} | {r.get('commit', '?')} |"
        )
    return "\n".join(lines) + "\n"
