"""docs/api-reference.md, generated from the CRDs in crds/ and the env contract.

    python -m pipejob.operator.apidoc > docs/api-reference.md

The CRDs are the source (what the API server enforces and `kubectl explain` prints), so the
reference says exactly what a cluster accepts; tests/test_docs.py keeps the file current."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from pipejob.core import contract
from pipejob.core.kinds import KINDS

ROOT = Path(__file__).resolve().parents[3]  # operator/pipejob/operator/apidoc.py
CRD_DIR = ROOT / "crds"


def load_crds(crd_dir: Path = CRD_DIR) -> list[dict[str, Any]]:
    """Every CustomResourceDefinition in `crd_dir`, ours in the order of the registry of kinds."""
    crds = []
    for path in sorted(crd_dir.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                crds.append(doc)
    order = {kind: i for i, kind in enumerate(KINDS)}
    return sorted(crds, key=lambda c: order.get(c["spec"]["names"]["kind"], len(order)))


def _cell(text: Any) -> str:
    """Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(value: Any) -> str:
    return f"`{json.dumps(value) if not isinstance(value, str) else value}`"


def _type(schema: dict[str, Any]) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "integer or string"
    kind = schema.get("type", "object")
    if kind == "array":
        return f"[]{_type(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        return f"map[string]{_type(schema['additionalProperties'])}"
    return kind


def _validation(schema: dict[str, Any]) -> str:
    parts = []
    if "enum" in schema:
        parts.append("one of " + ", ".join(_code(v) for v in schema["enum"]))
    # An int-or-string field's bounds apply to its integers and its pattern to its strings.
    either = schema.get("x-kubernetes-int-or-string")
    numbers, strings = ("an integer ", "a string ") if either else ("", "")
    if "minimum" in schema:
        op = ">" if schema.get("exclusiveMinimum") else ">="
        parts.append(f"{numbers}{op} {schema['minimum']}")
    if "maximum" in schema:
        parts.append(f"{numbers}<= {schema['maximum']}")
    if "pattern" in schema:
        parts.append(f"{strings}matches `{schema['pattern']}`")
    if "maxLength" in schema:
        parts.append(f"at most {schema['maxLength']} characters")
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        parts.append("any Kubernetes object")
    return "; ".join(parts)


def _rows(schema: dict[str, Any], path: str, required: bool) -> Iterator[list[str]]:
    """One table row per field under `schema`, depth first, in declaration order."""
    default = _code(schema["default"]) if "default" in schema else ""
    yield [
        f"`{path}`" + (" (required)" if required else ""),
        _type(schema),
        default,
        _validation(schema),
        schema.get("description", ""),
    ]
    if _kubernetes(schema):
        return  # a Kubernetes object: its own reference documents its fields
    needed = set(schema.get("required", []))
    for name, sub in (schema.get("properties") or {}).items():
        yield from _rows(sub, f"{path}.{name}", name in needed)
    if "additionalProperties" in schema and schema["additionalProperties"].get("properties"):
        yield from _rows_of_children(schema["additionalProperties"], f"{path}.<key>")
    items = schema.get("items") or {}
    if items.get("properties"):
        yield from _rows_of_children(items, f"{path}[]")


def _kubernetes(schema: dict[str, Any]) -> bool:
    """An embedded Kubernetes schema (core/k8s.py): its fields carry no descriptions."""
    node = schema.get("items") or schema
    fields = list((node.get("properties") or {}).values())
    return bool(fields) and not any("description" in f for f in fields)


def _rows_of_children(schema: dict[str, Any], path: str) -> Iterator[list[str]]:
    needed = set(schema.get("required", []))
    for name, sub in schema["properties"].items():
        yield from _rows(sub, f"{path}.{name}", name in needed)


def _rules(schema: dict[str, Any], path: str) -> Iterator[tuple[str, str, str]]:
    """(field path, CEL rule, message) of every x-kubernetes-validations under `schema`."""
    for rule in schema.get("x-kubernetes-validations", []):
        where = path + rule.get("fieldPath", "")
        yield where, rule["rule"], rule.get("message", "")
    for name, sub in (schema.get("properties") or {}).items():
        yield from _rules(sub, f"{path}.{name}")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def kind_section(crd: dict[str, Any]) -> list[str]:
    spec = crd["spec"]
    names = spec["names"]
    (version,) = [v for v in spec["versions"] if v.get("storage")]
    schema = version["schema"]["openAPIV3Schema"]
    out = [
        f"## {names['kind']}",
        "",
        f"`apiVersion: {spec['group']}/{version['name']}` · `kind: {names['kind']}` · "
        f"{spec['scope'].lower()} · plural `{names['plural']}` · "
        f"short names {', '.join(f'`{s}`' for s in names.get('shortNames', []))} · "
        f"categories {', '.join(f'`{c}`' for c in names.get('categories', []))}",
        "",
        _cell(schema["properties"]["spec"].get("description", "")),
        "",
    ]
    columns = version.get("additionalPrinterColumns", [])
    if columns:
        out += ["`kubectl get` columns:", ""]
        out += _table(
            ["Column", "Type", "From", "Description"],
            [
                [
                    c["name"] + (" (`-o wide`)" if c.get("priority") else ""),
                    c["type"],
                    f"`{c['jsonPath']}`",
                    c.get("description", ""),
                ]
                for c in columns
            ],
        )
        out.append("")
    for part in ("spec", "status"):
        if part not in schema["properties"]:
            continue
        out += [f"### {names['kind']} {part}", ""]
        rows = list(_rows(schema["properties"][part], part, False))[1:]
        out += _table(["Field", "Type", "Default", "Validation", "Description"], rows)
        out.append("")
        rules = list(_rules(schema["properties"][part], part))
        if part == "spec":  # rules on the whole object (its name) belong with the spec's
            rules = [
                ("(object)", r["rule"], r.get("message", ""))
                for r in schema.get("x-kubernetes-validations", [])
            ] + rules
        if rules:
            out += [
                "Cross-field rules (CEL, enforced by the API server; `pipejob validate` "
                "and the operator check the same):",
                "",
            ]
            out += _table(
                ["Field", "Rule", "Message"],
                [[p if p.startswith("(") else f"`{p}`", f"`{r}`", m] for p, r, m in rules],
            )
            out.append("")
    return out


def env_section() -> list[str]:
    out = [
        "## Env contract",
        "",
        "The environment of every training process (pod or local process), set from the "
        "world plan. The trainer reads nothing else. From `pipejob.core.contract`.",
        "",
    ]
    out += _table(["Variable", "Meaning"], [[f"`{k}`", v] for k, v in contract.DOCS.items()])
    out.append("")
    return out


def render(crd_dir: Path = CRD_DIR) -> str:
    lines = [
        "# API reference",
        "",
        "<!-- Generated by `python -m pipejob.operator.apidoc > docs/api-reference.md` from",
        "     crds/ and pipejob.core.contract: do not edit (tests/test_docs.py checks it). -->",
        "",
        "Both kinds share `spec.template` (pod overrides), the restart fields (`backoffLimit`, "
        "`activeDeadlineSeconds`, `ttlSecondsAfterFinished`, `suspend`) and the status. "
        "`kubectl explain pipelinejob.spec` prints the same descriptions.",
        "",
    ]
    for crd in load_crds(crd_dir):
        lines += kind_section(crd)
    lines += env_section()
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
