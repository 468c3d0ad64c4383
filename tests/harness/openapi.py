"""OpenAPI v3 of the served CRDs, so that `kubectl explain` documents them."""

from __future__ import annotations

from typing import Any

import kmock


def serve(path: str, schemas: dict[kmock.resource, dict[str, Any]]) -> dict[str, Any]:
    """`/openapi/v3` lists the group versions; `/openapi/v3/apis/<g>/<v>` holds their schemas."""
    versions = sorted({(r.group, r.version) for r in schemas})
    if path.rstrip("/") == "/openapi/v3":
        return {"paths": {f"apis/{g}/{v}": {"serverRelativeURL": f"/openapi/v3/apis/{g}/{v}"}
                          for g, v in versions}}  # fmt: skip
    components = {}
    for res, schema in schemas.items():
        if path.rstrip("/") == f"/openapi/v3/apis/{res.group}/{res.version}":
            kind = schema["kind"]
            reverse = ".".join(reversed(res.group.split(".")))
            components[f"{reverse}.{res.version}.{kind}"] = {
                **schema.get("openAPIV3Schema", {}),
                "x-kubernetes-group-version-kind": [
                    {"group": res.group, "version": res.version, "kind": kind}
                ],
            }
    if not components:
        raise kmock.KubernetesError(status=404, reason="NotFound", message=f"{path} not found")
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.31.0"},
            "paths": {}, "components": {"schemas": components}}  # fmt: skip
