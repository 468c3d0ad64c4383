"""A job manifest read as kubectl reads it (yamlio), defaulted and validated against its kind's
table (core/kinds/): `parse` is pipejob's one validation, which `pipejob validate`, `run`,
`plan`, `render` and the operator all go through. Every error names its field path."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from pipejob.core import elastic, validate, yamlio
from pipejob.core.common_spec import DNS_LABEL, CommonSpec, RunControl, from_spec, run_control
from pipejob.core.errors import SpecError, shown
from pipejob.core.kind import Kind
from pipejob.core.kinds import KINDS
from pipejob.core.schema import apply

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
    # The size its world runs at (core/elastic.py); None: the spec's largest. And how many
    # times the world has changed size: a gang of another size is a new gang.
    size: int | None = None
    resizes: int = 0

    @property
    def definition(self) -> Kind:
        """The kind's declaration (core/kinds/)."""
        return KINDS[self.kind]

    @cached_property
    def shape(self) -> CommonSpec:
        """The settings with their elastic size the number the world runs at: what the roles
        and groups are counted from (made once per Job)."""
        return elastic.shape(self.definition, self.settings, self.size)

    @cached_property
    def settings(self) -> CommonSpec:
        """The spec as its kind's typed object (core/kinds/: PipelineSpec, HybridSpec), what
        everything past the parser reads; made once per Job."""
        return from_spec(self.definition.settings, self.spec)

    @cached_property
    def control(self) -> RunControl:
        """The spec's fields only the operator reads (common_spec.OPERATOR_ONLY), typed; made
        once per Job."""
        return run_control(self.spec)

    def sized(self, size: int | None, resizes: int | None = None) -> Job:
        """This job with its world at `size` (None: the largest), and `resizes` if given. Its
        settings and control, which do not depend on the size, are made once (here, if not
        yet) and shared by every size of it."""
        again = dataclasses.replace(
            self, size=size, resizes=self.resizes if resizes is None else resizes
        )
        vars(again).update(settings=self.settings, control=self.control)  # cached_property's
        return again

    @property
    def spec_json(self) -> str:
        return json.dumps(self.spec, sort_keys=True, separators=(",", ":"))


def parse(
    manifest: Any, source: str = "manifest", allow_node_volumes: bool = False, cluster: bool = False
) -> Job:
    """Validate and default one job manifest (a dict as loaded from YAML); node-level
    volumes (hostPath, ...) pass only with `allow_node_volumes`; `cluster` adds what only a
    cluster refuses (validate.on_cluster)."""
    if not isinstance(manifest, dict):
        raise InvalidSpec([SpecError("(document)", "must be a mapping")], source)
    errors = _header_errors(manifest)
    meta = manifest.get("metadata")
    name = namespace = uid = None
    if not isinstance(meta, dict):
        errors.append(SpecError("metadata", "is required and must be a mapping"))
    else:
        name, namespace, uid = meta.get("name"), meta.get("namespace"), meta.get("uid")
        errors += _namespace_errors(namespace) + _name_errors(name)
    kind = manifest.get("kind")
    spec_in = manifest.get("spec", {})
    spec: dict[str, Any] = {}
    if spec_in is None:
        spec_in = {}
    if kind in KINDS:
        spec = apply(KINDS[kind].spec, spec_in, "spec", errors)
    if errors:
        raise InvalidSpec(errors, source)
    spec = KINDS[kind].complete(spec)
    errors = validate.check(kind, spec, allow_node_volumes, cluster)
    if errors:
        raise InvalidSpec(errors, source)
    return Job(kind=kind, name=name, namespace=namespace, spec=spec, uid=uid)


def _header_errors(manifest: dict[str, Any]) -> list[SpecError]:
    """A wrong apiVersion or kind, and top-level keys a manifest does not have."""
    errors = []
    if manifest.get("apiVersion") != API_VERSION:
        errors.append(
            SpecError(
                "apiVersion", f"must be {API_VERSION}, got {shown(manifest.get('apiVersion'))}"
            )
        )
    kind = manifest.get("kind")
    if kind not in KINDS:
        errors.append(SpecError("kind", f"must be one of {', '.join(KINDS)}, got {shown(kind)}"))
    for key in manifest:
        if key not in ("apiVersion", "kind", "metadata", "spec", "status"):
            errors.append(SpecError(key, "unknown top-level field"))
    return errors


def _namespace_errors(namespace: Any) -> list[SpecError]:
    """A namespace, when given, is a DNS label."""
    if namespace is None or (
        isinstance(namespace, str)
        and len(namespace) <= 63
        and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", namespace)
    ):
        return []
    return [
        SpecError(
            "metadata.namespace",
            f"must be a DNS label of at most 63 characters, got {shown(namespace)}",
        )
    ]


def _name_errors(name: Any) -> list[SpecError]:
    """A job's name is a DNS label short enough for its pods' names."""
    if not isinstance(name, str) or not name:
        return [SpecError("metadata.name", "is required")]
    if not re.fullmatch(DNS_LABEL, name):
        return [
            SpecError(
                "metadata.name",
                f"must be a DNS label (lowercase letters, digits, '-', starting with a letter),"
                f" got {shown(name)}",
            )
        ]
    if len(name) > MAX_JOB_NAME:
        return [
            SpecError(
                "metadata.name",
                f"must be at most {MAX_JOB_NAME} characters so pod names stay DNS labels",
            )
        ]
    return []


def load(path: str | Path, allow_node_volumes: bool = False, cluster: bool = False) -> Job:
    """Read one job manifest file; errors name the file (and the YAML line if it is bad YAML)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(yamlio.MAX_BYTES + 1)  # a bigger file is refused, not read whole
    except OSError as e:
        raise InvalidSpec([SpecError("(file)", e.strerror or str(e))], str(path)) from None
    try:
        docs = yamlio.load_all(yamlio.decode(data))
    except yamlio.YamlError as e:
        where = f"line {e.line}" if e.line else "(document)"
        raise InvalidSpec([SpecError(where, f"not valid YAML: {e.reason}")], str(path)) from None
    if len(docs) != 1:
        raise InvalidSpec(
            [SpecError("(document)", f"must hold exactly one job, found {len(docs)} documents")],
            str(path),
        )
    return parse(docs[0], str(path), allow_node_volumes, cluster)
