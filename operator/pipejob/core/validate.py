"""The checks a spec's table cannot express, each naming its field path and the reason;
`spec.parse` runs them after the table's defaults and rules. What depends on the operator's
configuration or only a cluster refuses (`on_cluster`) comes in as a parameter.
docs/architecture.md, "The spec and its validation, part by part"."""

from __future__ import annotations

import json
import posixpath
from typing import Any

from pipejob.core import contract, elastic
from pipejob.core.common_spec import CommonSpec, from_spec
from pipejob.core.errors import SpecError, shown
from pipejob.core.kind import Kind
from pipejob.core.kinds import KINDS

# The spec travels to every process in one environment variable (PIPEJOB_SPEC); Linux caps
# one at 128 KiB, and the rest of the env needs room too.
MAX_SPEC_BYTES = 64 * 1024

# Volume types that reach into the node: refused unless the operator allows them, as the
# Pod Security "baseline" level refuses hostPath. A user allowed to create jobs but not pods
# would otherwise get the node through the operator.
NODE_VOLUMES = {
    "hostPath": "mounts a directory of the node",
    "gitRepo": "runs git on the node",
    "flexVolume": "runs a driver binary on the node",
}
ALLOW_NODE_VOLUMES_ENV = "PIPEJOB_ALLOW_NODE_VOLUMES"


def check(
    kind: str, spec: dict[str, Any], allow_node_volumes: bool = False, cluster: bool = False
) -> list[SpecError]:
    """Everything wrong with a defaulted, table-valid `spec` of `kind` that no pod could run
    (with `cluster`, also what would go wrong on a cluster only)."""
    template = spec.get("template") or {}
    errors = _env_errors(template) + _volume_errors(template, allow_node_volumes)
    errors += _checkpoint_errors(spec, template)
    if cluster and not errors:
        errors += on_cluster(kind, spec)
    errors += KINDS[kind].check(spec)  # the kind's own (a model too small to cut, ...)
    size = _json_bytes(spec)
    if size > MAX_SPEC_BYTES:
        where, most = _largest_field(spec, "spec")
        errors.append(
            SpecError(
                "spec",
                (
                    f"is {size} bytes as JSON; at most {MAX_SPEC_BYTES} fit in the {contract.SPEC}"
                    f" environment variable every process gets (Linux caps one at 128 KiB); the"
                    f" largest field is {where} ({most} bytes)"
                ),
            )
        )
    return errors


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())


def _largest_field(value: Any, path: str) -> tuple[str, int]:
    """The innermost field holding most of `value`'s bytes, and its bytes: what to shorten."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    parts = [(f"{path}.{k}" if isinstance(value, dict) else f"{path}[{k}]", v) for k, v in items]
    if not parts:
        return path, _json_bytes(value)
    where, inner = max(parts, key=lambda part: _json_bytes(part[1]))
    if isinstance(inner, dict | list) and _json_bytes(inner) * 2 > _json_bytes(value):
        return _largest_field(inner, where)
    return where, _json_bytes(inner)


def allowed_by_env(environ: dict[str, str]) -> bool:
    """The operator's allowance from its environment (the chart sets it)."""
    return environ.get(ALLOW_NODE_VOLUMES_ENV, "").lower() in ("1", "true", "yes")


def _env_errors(template: dict) -> list[SpecError]:
    errors = []
    for i, entry in enumerate(template.get("env") or []):
        name = entry.get("name")
        if name in contract.DOCS:
            why = f"{name} is set by pipejob (the env contract); choose another name"
            errors.append(SpecError(f"spec.template.env[{i}].name", why))
    return errors


def _volume_errors(template: dict, allow_node_volumes: bool) -> list[SpecError]:
    errors = []
    names = {v.get("name") for v in template.get("volumes") or []}
    for i, volume in enumerate(template.get("volumes") or []):
        for source, what in NODE_VOLUMES.items():
            if source in volume and not allow_node_volumes:
                errors.append(
                    SpecError(
                        f"spec.template.volumes[{i}].{source}",
                        (
                            f"a {source} volume {what}; the operator refuses node-level volumes"
                            " unless it runs with --allow-node-volumes (chart value"
                            " allowNodeVolumes)"
                        ),
                    )
                )
    for i, mount in enumerate(template.get("volumeMounts") or []):
        if mount.get("name") not in names:
            why = f"no volume {shown(mount.get('name'))} in spec.template.volumes"
            errors.append(SpecError(f"spec.template.volumeMounts[{i}].name", why))
    return errors


def _checkpoint_errors(spec: dict, template: dict) -> list[SpecError]:
    """The checkpoint volume must exist and mount where no template mount already is."""
    checkpoint = spec.get("checkpoint") or {}
    name, path = checkpoint.get("volume"), checkpoint.get("path") or ""
    if not name:
        return []
    if name not in {v.get("name") for v in template.get("volumes") or []}:
        return [
            SpecError("spec.checkpoint.volume", f"no volume {shown(name)} in spec.template.volumes")
        ]
    if not posixpath.isabs(path):
        why = f"must be an absolute path to mount volume {shown(name)} at, got {shown(path)}"
        return [SpecError("spec.checkpoint.path", why)]
    for i, mount in enumerate(template.get("volumeMounts") or []):
        there = mount.get("mountPath")
        if there and posixpath.normpath(there) == posixpath.normpath(path):
            why = f"spec.template.volumeMounts[{i}] mounts {shown(path)} already; omit the volume"
            return [SpecError("spec.checkpoint.volume", why)]
    return []


def pod_count(kind: Kind, settings: CommonSpec) -> int:
    """How many pods a world of `kind` with these settings has (at its largest size)."""
    world = elastic.shape(kind, settings)
    return sum(role.members(world) * role.copies(world) for role in kind.roles)


def _is_under(path: str, mount: str) -> bool:
    path, mount = posixpath.normpath(path), posixpath.normpath(mount)
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def on_cluster(kind: str, spec: dict[str, Any]) -> list[SpecError]:
    """A world of several pods whose checkpoint is on no volume: each pod would write to its
    own container filesystem, and a restarted world would find no checkpoint, silently."""
    checkpoint = spec.get("checkpoint") or {}
    path = checkpoint.get("path")
    if not path or checkpoint.get("volume"):
        return []
    pods = pod_count(KINDS[kind], from_spec(KINDS[kind].settings, spec))
    if pods < 2:
        return []
    mounts = [
        m.get("mountPath") or "" for m in (spec.get("template") or {}).get("volumeMounts") or []
    ]
    if posixpath.isabs(path) and any(m and _is_under(path, m) for m in mounts):
        return []
    why = (
        f"{shown(path)} is on no volume: each of the job's {pods} pods would write"
        " its own container filesystem and a restarted world would find no checkpoint;"
        " add checkpoint.volume (a volume of template.volumes that every pod mounts at"
        " this path), or mount a shared volume at or above it in template.volumeMounts"
    )
    return [SpecError("spec.checkpoint.path", why)]
