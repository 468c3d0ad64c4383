#!/usr/bin/env python3
"""Generate operator/pipejob/core/k8s_schemas.json: the structural schemas of the Kubernetes
objects a job's pod template passes through (env, resources, volumes, ...), and of the
NetworkPolicy parts the operator's settings give (peers, egress rules), from the Kubernetes
OpenAPI that the `kubernetes-validate` package ships for one pinned version.

The CRDs embed these schemas and `pipejob validate` checks with them, so both refuse the
same mistakes without the operator image needing this package. Run it with the tools venv
(scripts/install-tools.sh installs kubernetes-validate there):

    ~/.cache/pipejob/tools/venv/bin/python scripts/k8s-schemas.py          # write the file
    ~/.cache/pipejob/tools/venv/bin/python scripts/k8s-schemas.py --check  # exit 1 if stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

KUBERNETES = "1.28.0"  # the oldest version pipejob supports (the CRDs' CEL rules need it)
OUT = Path(__file__).resolve().parent.parent / "operator/pipejob/core/k8s_schemas.json"
CORE, NETWORKING = "io.k8s.api.core.v1.", "io.k8s.api.networking.v1."
TYPES = {
    **{
        name: CORE + name
        for name in (
            "EnvVar",
            "ResourceRequirements",
            "Volume",
            "VolumeMount",
            "Affinity",
            "Toleration",
        )
    },
    **{name: NETWORKING + name for name in ("NetworkPolicyPeer", "NetworkPolicyEgressRule")},
}

QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
# Kubernetes' resource.Quantity syntax (its own regular expression, written out).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DNS_LABEL = {"pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
# What the API server's Pod validation refuses though its OpenAPI does not say so.
TIGHTER: dict[tuple[str, str], dict[str, Any]] = {
    ("Volume", "name"): DNS_LABEL,
    ("VolumeMount", "name"): DNS_LABEL,
    ("EnvVar", "name"): {"pattern": "^[-._a-zA-Z][-._a-zA-Z0-9]*$"},
    ("Toleration", "operator"): {"enum": ["Exists", "Equal"]},
    ("Toleration", "effect"): {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
}
# Kept from the OpenAPI: what a structural schema may hold and the API server enforces.
KEEP = (
    "required",
    "enum",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
)


def definitions() -> dict[str, Any]:
    import kubernetes_validate  # the tools venv's

    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    path = root / f"v{KUBERNETES}-local-strict" / "_definitions.json"
    return json.loads(path.read_text())["$defs"]


def structural(schema: dict[str, Any], defs: dict[str, Any], seen: tuple[str, ...]) -> dict:
    """`schema` with every $ref inlined, one type per node (no null), no descriptions."""
    ref = schema.get("$ref")
    if ref is not None:
        name = ref.rsplit("/", 1)[-1]
        if name in (QUANTITY, INT_OR_STRING):
            out = {
                "x-kubernetes-int-or-string": True,
                "anyOf": [{"type": "integer"}, {"type": "string"}],
            }
            if name == QUANTITY:
                out["pattern"] = QUANTITY_PATTERN
            return out
        if name in seen:
            raise SystemExit(f"recursive type {name}: cannot inline it")
        return structural(defs[name], defs, (*seen, name))
    types = schema.get("type")
    types = [t for t in types if t != "null"] if isinstance(types, list) else [types]
    out: dict[str, Any] = {"type": types[0]} if types and types[0] else {}
    for key in KEEP:
        if key in schema:
            out[key] = schema[key]
    if "properties" in schema:
        out["properties"] = {k: structural(v, defs, seen) for k, v in schema["properties"].items()}
    elif isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(schema["additionalProperties"], defs, seen)
    elif out.get("type") == "object":
        out["x-kubernetes-preserve-unknown-fields"] = True  # a free-form object in Kubernetes
    if "items" in schema:
        out["items"] = structural(schema["items"], defs, seen)
    if out.get("x-kubernetes-list-type") == "map":
        keys = out.get("x-kubernetes-list-map-keys", [])
        if not set(keys) <= set(out["items"].get("required", [])):
            del out["x-kubernetes-list-type"], out["x-kubernetes-list-map-keys"]
    return out


def generate() -> dict[str, Any]:
    defs = definitions()
    out: dict[str, Any] = {"kubernetes": KUBERNETES}
    for name, full in TYPES.items():
        schema = structural(defs[full], defs, (full,))
        for (owner, field), extra in TIGHTER.items():
            if owner == name:
                schema["properties"][field].update(extra)
        out[name] = schema
    return out


def render() -> str:
    return json.dumps(generate(), indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run scripts/k8s-schemas.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} (Kubernetes {KUBERNETES})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
