"""A job manifest read, defaulted and validated against its kind's table (core/kinds/).

The manifest is the very YAML a user `kubectl apply`s. Every error names its field path."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipejob.core.common import DNS_LABEL, from_spec
from pipejob.core.kind import Kind
from pipejob.core.kinds import KINDS
from pipejob.core.schema import SpecError, apply

GROUP = "pipejob.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
# Pod names are "<job>-<role>-<index>" and must stay valid DNS labels (63 characters).
MAX_JOB_NAME = 40


class InvalidSpec(ValueError):
    """A manifest that cannot run; `errors` names each field path and the reason."""

    def __init__(self, errors: list[SpecError], source: str = "manifest"):
        self.errors = errors
        self.source = source
        lines = "\n".join(f"  {e}" for e in errors)
        super().__init__(f"{source}: invalid job:\n{lines}")


@dataclass(frozen=True)
class Job:
    kind: str
    name: str
    namespace: str | None
    spec: dict[str, Any]  # defaulted and validated, camelCase as in the manifest
    uid: str | None = None

    @property
    def definition(self) -> Kind:
        """The kind's declaration (core/kinds/)."""
        return KINDS[self.kind]

    @property
    def settings(self) -> Any:
        """The spec as its kind's typed object (what the trainer reads)."""
        return from_spec(self.definition.settings, self.spec)

    @property
    def spec_json(self) -> str:
        return json.dumps(self.spec, sort_keys=True, separators=(",", ":"))


def parse(manifest: Any, source: str = "manifest") -> Job:
    """Validate and default one job manifest (a dict as loaded from YAML)."""
    errors: list[SpecError] = []
    if not isinstance(manifest, dict):
        raise InvalidSpec([SpecError("(document)", "must be a mapping")], source)
    if manifest.get("apiVersion") != API_VERSION:
        errors.append(SpecError(
            "apiVersion", f"must be {API_VERSION}, got {manifest.get('apiVersion')!r}"
        ))  # fmt: skip
    kind = manifest.get("kind")
    if kind not in KINDS:
        errors.append(SpecError("kind", f"must be one of {', '.join(KINDS)}, got {kind!r}"))
    for key in manifest:
        if key not in ("apiVersion", "kind", "metadata", "spec", "status"):
            errors.append(SpecError(key, "unknown top-level field"))
    meta = manifest.get("metadata")
    name = namespace = uid = None
    if not isinstance(meta, dict):
        errors.append(SpecError("metadata", "is required and must be a mapping"))
    else:
        name, namespace, uid = meta.get("name"), meta.get("namespace"), meta.get("uid")
        if not isinstance(name, str) or not name:
            errors.append(SpecError("metadata.name", "is required"))
        elif not re.fullmatch(DNS_LABEL, name):
            errors.append(SpecError(
                "metadata.name",
                f"must be a DNS label (lowercase letters, digits, '-', starting with a letter),"
                f" got {name!r}",
            ))  # fmt: skip
        elif len(name) > MAX_JOB_NAME:
            errors.append(SpecError(
                "metadata.name",
                f"must be at most {MAX_JOB_NAME} characters so pod names stay DNS labels",
            ))  # fmt: skip
    spec_in = manifest.get("spec", {})
    spec: dict[str, Any] = {}
    if spec_in is None:
        spec_in = {}
    if kind in KINDS:
        spec = apply(KINDS[kind].spec, spec_in, "spec", errors)
    if errors:
        raise InvalidSpec(errors, source)
    spec = KINDS[kind].complete(spec)
    return Job(kind=kind, name=name, namespace=namespace, spec=spec, uid=uid)


def load(path: str | Path) -> Job:
    """Read one job manifest file; errors name the file (and the YAML line if it is bad YAML)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise InvalidSpec([SpecError("(file)", e.strerror or str(e))], str(path)) from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(document)"
        reason = getattr(e, "problem", None) or str(e)
        raise InvalidSpec([SpecError(where, f"not valid YAML: {reason}")], str(path)) from None
    if len(docs) != 1:
        raise InvalidSpec(
            [SpecError("(document)", f"must hold exactly one job, found {len(docs)} documents")],
            str(path),
        )
    return parse(docs[0], str(path))
