"""Validate Kubernetes manifests as an API server would, without one.

    ~/.cache/pipejob/tools/venv/bin/python scripts/validate-manifests.py \\
        --crds crds --kubernetes-version 1.37.0 FILE.yaml...

Built-in kinds: kubernetes-validate's strict schemas of each given Kubernetes version.
Custom resources: their CustomResourceDefinition from --crds (structural schema as JSON
Schema, unknown fields rejected as the API server's strict field validation does; then the
schema's defaults and its x-kubernetes-validations CEL rules, with cel-python). A kind with
no schema is an error, never a silent pass. Prints one JSON line per resource; exit 1 if any
resource is invalid.

Runs in the tools venv (scripts/install-tools.sh), which has kubernetes-validate, jsonschema
and cel-python; the project's venv does not need them."""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

_COPIED = (
    "type",
    "enum",
    "minimum",
    "maximum",
    "pattern",
    "maxLength",
    "minLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "required",
)


def json_schema(s: dict[str, Any]) -> dict[str, Any]:
    """A CRD's structural OpenAPI v3 schema as a JSON Schema (draft 2020-12)."""
    out = {k: s[k] for k in _COPIED if k in s}
    if s.get("x-kubernetes-int-or-string"):  # minimum bounds its integers, pattern its strings
        return out | {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    if s.get("exclusiveMinimum") is True:  # OpenAPI 3.0's boolean form
        out["exclusiveMinimum"] = out.pop("minimum")
    if s.get("exclusiveMaximum") is True:
        out["exclusiveMaximum"] = out.pop("maximum")
    if s.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "items" in s:
        out["items"] = json_schema(s["items"])
    if "properties" in s:
        out["properties"] = {k: json_schema(v) for k, v in s["properties"].items()}
        if not s.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False  # the API server prunes or rejects these
    if isinstance(s.get("additionalProperties"), dict):
        out["additionalProperties"] = json_schema(s["additionalProperties"])
    return out


def defaulted(s: dict[str, Any], value: Any) -> Any:
    """`value` with the schema's defaults filled in, as the API server does before CEL."""
    if isinstance(value, dict):
        value = dict(value)
        for key, sub in (s.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = defaulted(sub, value[key])
        if isinstance(s.get("additionalProperties"), dict):
            for key in set(value) - set(s.get("properties") or {}):
                value[key] = defaulted(s["additionalProperties"], value[key])
    elif isinstance(value, list) and "items" in s:
        value = [defaulted(s["items"], v) for v in value]
    return value


_CEL = celpy.Environment()
# Property names the API server shows to CEL escaped, being CEL's reserved words: a rule on
# a field `import` reads `self.__import__`.
_RESERVED = frozenset(
    "true false null in as break const continue else for function if import"
    " let loop package namespace return var void while".split()
)


def as_cel_sees(value: Any) -> Any:
    if isinstance(value, dict):
        return {(f"__{k}__" if k in _RESERVED else k): as_cel_sees(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_cel_sees(v) for v in value]
    return value


def cel_errors(s: dict[str, Any], value: Any, path: str) -> list[str]:
    """Messages of the x-kubernetes-validations rules that `value` breaks."""
    errors = []
    for rule in s.get("x-kubernetes-validations") or []:
        program = _CEL.program(_CEL.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(as_cel_sees(value))})
        if not isinstance(result, celpy.celtypes.BoolType):  # e.g. a CELEvalError
            errors.append(f"{path or '(root)'}: rule {rule['rule']!r} did not evaluate: {result}")
        elif not result:
            where = path + rule.get("fieldPath", "")
            errors.append(f"{where.lstrip('.') or '(root)'}: {rule.get('message') or rule['rule']}")
    if isinstance(value, dict):
        for key, sub in (s.get("properties") or {}).items():
            if key in value:
                errors += cel_errors(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in s:
        for i, v in enumerate(value):
            errors += cel_errors(s["items"], v, f"{path}[{i}]")
    return errors


def list_map_errors(s: dict[str, Any], value: Any, path: str) -> list[str]:
    """Entries of x-kubernetes-list-type: map lists that share their keys (the API server
    refuses them; JSON Schema cannot say it)."""
    errors = []
    if isinstance(value, list):
        keys = s.get("x-kubernetes-list-map-keys") or []
        if s.get("x-kubernetes-list-type") == "map" and keys:
            seen = set()
            for i, item in enumerate(value):
                key = json.dumps([item.get(k) for k in keys]) if isinstance(item, dict) else None
                if key in seen:
                    errors.append(f"{path}[{i}]: duplicate entry with keys {key}")
                seen.add(key)
        for i, item in enumerate(value):
            errors += list_map_errors(s.get("items") or {}, item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, sub in (s.get("properties") or {}).items():
            if key in value:
                errors += list_map_errors(sub, value[key], f"{path}.{key}")
    return errors


def load_crds(dirs: list[Path]) -> dict[tuple[str, str], dict[str, Any]]:
    """{(apiVersion, kind): openAPIV3Schema} of every served version of every CRD in dirs."""
    schemas = {}
    for directory in dirs:
        for path in sorted(directory.glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if not doc or doc.get("kind") != "CustomResourceDefinition":
                    continue
                spec = doc["spec"]
                for version in spec["versions"]:
                    if version.get("served"):
                        key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                        schemas[key] = version["schema"]["openAPIV3Schema"]
    return schemas


# What the API server adds to every custom resource's schema.
_ROOT = {
    "apiVersion": {"type": "string"},
    "kind": {"type": "string"},
    "metadata": {"type": "object"},
}


def validate_custom(doc: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    schema = dict(schema, properties={**_ROOT, **(schema.get("properties") or {})})
    validator = jsonschema.Draft202012Validator(json_schema(schema))
    errors = [
        f"{'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    ]
    if not errors:  # CEL rules assume a structurally valid, defaulted object
        errors = list_map_errors(schema, doc, "") + cel_errors(schema, defaulted(schema, doc), "")
    return errors


def validate_builtin(doc: dict[str, Any], versions: list[str]) -> list[str]:
    errors = []
    for version in versions:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path) or "(root)"
            errors.append(f"Kubernetes {version}: {path}: {e.message}")
        except SchemaNotFoundError as e:
            errors.append(e.message)
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument(
        "--crds",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="directory of CustomResourceDefinitions (repeatable)",
    )
    parser.add_argument(
        "--kubernetes-version",
        action="append",
        dest="versions",
        metavar="X.Y.Z",
        help="validate built-in kinds for this version "
        "(repeatable; default: kubernetes-validate's latest)",
    )
    args = parser.parse_args(argv)
    versions = args.versions or [kubernetes_validate.utils.latest_version()]
    crds = load_crds(args.crds)
    failed = False
    for path in args.files:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            key = (doc.get("apiVersion"), doc.get("kind"))
            if key in crds:
                schema, errors = f"CRD {key[1]}", validate_custom(doc, crds[key])
            else:
                schema, errors = (
                    "Kubernetes " + ", ".join(versions),
                    validate_builtin(doc, versions),
                )
            failed |= bool(errors)
            print(
                json.dumps(
                    {
                        "file": str(path),
                        "kind": doc.get("kind"),
                        "name": (doc.get("metadata") or {}).get("name"),
                        "schema": schema,
                        "errors": errors,
                    }
                )
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
