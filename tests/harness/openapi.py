"""OpenAPI v3 as kubectl reads it, and strict field validation of custom resources.

kubectl apply validates by asking the server: it looks in /openapi/v3 for a PATCH operation of
the kind with a `fieldValidation` parameter, then sends `fieldValidation=Strict` (without it,
kubectl falls back to the protobuf OpenAPI v2, which is not served here). The emulator honours
Strict for custom resources by refusing fields their CRD's schema does not have; builtin kinds
are not checked. `kubectl explain` reads the CRD schemas from the same documents."""

from __future__ import annotations

from typing import Any

import kmock

GVK = "x-kubernetes-group-version-kind"


def serve(path: str, resources: kmock.ResourcesArray, schemas: dict[kmock.resource, dict]) -> dict:
    path = path.rstrip("/")
    served = {r for r in resources if r.plural and "/" not in r.plural}
    if path == "/openapi/v3":
        return {
            "paths": {
                _gv_path(r): {"serverRelativeURL": f"/openapi/v3/{_gv_path(r)}"} for r in served
            }
        }
    members = [r for r in served if path == f"/openapi/v3/{_gv_path(r)}"]
    if not members:
        raise kmock.KubernetesError(status=404, reason="NotFound", message=f"{path} not found")
    paths, components = {}, {}
    for res in members:
        info = resources[res]
        gvk = {"group": res.group, "version": res.version, "kind": info.kind}
        scope = "namespaces/{namespace}/" if info.namespaced else ""
        paths[f"/{_gv_path(res)}/{scope}{res.plural}/{{name}}"] = {
            "patch": {
                GVK: gvk,
                "parameters": [
                    {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}
                ],
                "responses": {"200": {"description": "OK"}},
            }
        }
        if res in schemas:
            reverse = ".".join(reversed(res.group.split(".")))
            components[f"{reverse}.{res.version}.{info.kind}"] = {**schemas[res], GVK: [gvk]}
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.26.4"},
        "paths": paths,
        "components": {"schemas": components},
    }


def _gv_path(res: kmock.resource) -> str:
    return f"api/{res.version}" if res.group == "" else f"apis/{res.group}/{res.version}"


def unknown_fields(value: Any, schema: Any, path: str = "") -> list[str]:
    """Field paths in `value` that a structural schema does not declare."""
    if not isinstance(schema, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict) and schema.get("type") == "object":
        declared, extra = schema.get("properties"), schema.get("additionalProperties")
        found = []
        for key, item in value.items():
            at = f"{path}.{key}" if path else key
            if declared is not None and key in declared:
                found += unknown_fields(item, declared[key], at)
            elif isinstance(extra, dict):
                found += unknown_fields(item, extra, at)
            elif declared is not None or extra is False:
                found.append(at)
        return found
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [
            f
            for i, item in enumerate(value)
            for f in unknown_fields(item, schema["items"], f"{path}[{i}]")
        ]
    return []
