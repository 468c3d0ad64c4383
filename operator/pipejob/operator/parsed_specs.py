"""The jobs' specs as parsed (core.spec.parse: the schema's defaults, the completion, the
checks), kept between reconciles: parsing was about a third of a reconcile's decision, and
the resync judges every job every round (issue 60: 5,000 jobs). One entry per job uid,
used while the job's spec and header are those it was parsed from, and the least recently
used dropped past `LIMIT`, so a deleted job's entry does not stay for ever."""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Any

from pipejob.core.k8s import KubeObject
from pipejob.core.spec import InvalidSpec, Job, parse

# About 3 kB an entry (the completed spec); above the jobs one operator is measured at, so
# that a resync round over all of them finds each one's entry.
LIMIT = 10_000

_lock = threading.Lock()
_kept: OrderedDict[str, tuple[tuple, Any, Job | InvalidSpec]] = OrderedDict()


def parsed(job_obj: KubeObject, allow_node_volumes: bool) -> Job | InvalidSpec:
    """The job as its spec says, or what is wrong with the spec, as `parse` says for a
    cluster's job named by its kind and name."""
    meta = job_obj.get("metadata")
    uid = meta.get("uid") if isinstance(meta, dict) else None
    if not isinstance(uid, str):  # nothing to know it by
        return _parse(job_obj, allow_node_volumes)
    # What parse reads besides the spec (a spec is compared apart: a copy of it is kept).
    header = (
        job_obj.get("apiVersion"),
        job_obj.get("kind"),
        meta.get("name"),
        meta.get("namespace"),
        tuple(job_obj),
        allow_node_volumes,
    )
    spec = job_obj.get("spec")
    with _lock:
        found = _kept.get(uid)
        if found is not None and found[0] == header and found[1] == spec:
            _kept.move_to_end(uid)
            return found[2]
    result = _parse(job_obj, allow_node_volumes)
    with _lock:
        _kept[uid] = (header, copy.deepcopy(spec), result)
        _kept.move_to_end(uid)
        while len(_kept) > LIMIT:
            _kept.popitem(last=False)
    return result


def _parse(job_obj: KubeObject, allow_node_volumes: bool) -> Job | InvalidSpec:
    meta = job_obj.get("metadata") if isinstance(job_obj.get("metadata"), dict) else {}
    name = f"{job_obj.get('kind')} {meta.get('name')}"
    try:
        return parse(job_obj, name, allow_node_volumes, cluster=True)
    except InvalidSpec as e:
        return e
