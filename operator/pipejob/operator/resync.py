"""The resync's sieve. Every PIPEJOB_RESYNC_SECONDS the operator looks at every job again, for
deadlines, TTLs and missed events; reconciling each one (a GET of the job, a LIST of its
pods) costs the API server two requests a job, 1,000 a round at 500 jobs, nearly all to find
nothing to do. Instead one LIST of each kind's jobs and one of every job's pods per namespace
make a snapshot, `reconcile.decide` runs on it, and only the jobs it would act on (or that
are gone, or whose master runs and is polled) are reconciled afresh: what the snapshot shows
only chooses which, never what is done."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from pipejob.core import scheduling as sch
from pipejob.core.kinds import by_plural
from pipejob.operator.actions import Actions
from pipejob.operator.cluster import Cluster
from pipejob.operator.kube import JOB_LABEL

Key = tuple[str, str, str]  # (plural, namespace, name)
Decide = Callable[[dict, list[dict], datetime], Actions]


def snapshot(cluster: Cluster, keys: Iterable[Key]) -> tuple[dict[Key, dict], dict]:
    """The jobs of the kinds and namespaces of `keys`, by key, and every job's pods, by
    (namespace, job name): one LIST a kind and one of pods per namespace."""
    jobs: dict[Key, dict] = {}
    pods: dict[tuple[str, str], list[dict]] = defaultdict(list)
    kinds_by_namespace: dict[str, set[str]] = defaultdict(set)
    for plural, namespace, _ in keys:
        kinds_by_namespace[namespace].add(plural)
    for namespace, plurals in sorted(kinds_by_namespace.items()):
        for plural in sorted(plurals):
            kind = by_plural(plural)
            for obj in cluster.list_jobs(kind.name if kind else plural, plural, namespace):
                jobs[(plural, namespace, obj["metadata"]["name"])] = obj
        for pod in cluster.list_pods(namespace):
            pods[(namespace, pod["metadata"]["labels"][JOB_LABEL])].append(pod)
    return jobs, pods


def idle(job: dict, acts: Actions) -> bool:
    """Whether `acts` would leave `job` as it is: no status change, nothing made or deleted,
    no Event."""
    return acts.status == (job.get("status") or {}) and not (
        acts.create or acts.delete or acts.events or acts.delete_job or acts.end_group
    )


def due(cluster: Cluster, keys: list[Key], polled: set[Key], decide: Decide) -> list[Key]:
    """Those of `keys` to reconcile: the ones in `polled`, the ones gone or being deleted,
    and the ones `decide` would act on as the snapshot shows them."""
    jobs, pods = snapshot(cluster, keys)
    now = datetime.now(UTC)
    out = []
    for key in keys:
        job = jobs.get(key)
        if key in polled or job is None or job["metadata"].get("deletionTimestamp"):
            out.append(key)
        elif sch.managed_elsewhere(job):  # the reconcile would leave it at once
            continue
        else:
            try:
                acts = decide(job, pods.get((key[1], key[2]), []), now)
            except Exception:  # the reconcile will fail the same way, and say why
                out.append(key)
                continue
            if not idle(job, acts):
                out.append(key)
    return out
