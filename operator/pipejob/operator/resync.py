"""The resync's sieve. Every PIPEJOB_RESYNC_SECONDS the operator looks at every job again, for
deadlines, TTLs and missed events; reconciling each one (a GET of the job, a LIST of its
pods) costs the API server two requests a job, 2,000 a round at 1,000 jobs, nearly all to
find nothing to do. Instead one LIST of each kind's jobs per namespace, and one LIST of the
pods of each hundred jobs, make a snapshot; `reconcile.decide` runs on it, and only the jobs
it would act on (or that are gone) are reconciled afresh: what the snapshot shows only
chooses which, never what is done. A running master's progress is not the resync's: the
pollers read it (poll_schedule.py), and a job is reconciled only when its report changed.
The jobs are read in chunks of cluster.LIST_CHUNK and judged a chunk at a time, their pods a
hundred jobs at a time, so that the operator never holds every job or pod of the cluster at
once."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

from pipejob.core import scheduling as sch
from pipejob.core.k8s import KubeObject
from pipejob.core.kinds import by_plural
from pipejob.operator.actions import Actions
from pipejob.operator.cluster import Cluster
from pipejob.operator.kube import JOB_LABEL

Key = tuple[str, str, str]  # (plural, namespace, name)
Decide = Callable[[KubeObject, list[KubeObject], datetime], Actions]
CHUNK = 100  # jobs whose pods one LIST reads


def job_chunks(cluster: Cluster, keys: list[Key]) -> Iterator[dict[Key, KubeObject]]:
    """Those of `keys` that exist, by key, a LIST's chunk at a time: one LIST a kind a
    namespace (in chunks of cluster.LIST_CHUNK)."""
    wanted = set(keys)
    for plural, namespace in sorted({(k[0], k[1]) for k in keys}):
        kind = by_plural(plural)
        for chunk in cluster.list_jobs(kind.name if kind else plural, plural, namespace):
            found = {(plural, namespace, obj["metadata"]["name"]): obj for obj in chunk}
            yield {key: job for key, job in found.items() if key in wanted}


def with_pods(cluster: Cluster, keys: list[Key]) -> Iterator[tuple[Key, list[KubeObject]]]:
    """Each of `keys` with its pods, read a hundred jobs of a namespace at a time."""
    by_namespace: dict[str, list[Key]] = defaultdict(list)
    for key in keys:
        by_namespace[key[1]].append(key)
    for namespace, its in sorted(by_namespace.items()):
        for start in range(0, len(its), CHUNK):
            chunk = its[start : start + CHUNK]
            pods: dict[str, list[KubeObject]] = defaultdict(list)
            for pod in cluster.list_pods(namespace, sorted({k[2] for k in chunk})):
                pods[pod["metadata"]["labels"][JOB_LABEL]].append(pod)
            for key in chunk:
                yield key, pods.get(key[2], [])


def pause(interval: float, took: float) -> float:
    """Seconds until the next round, after one that took `took`: `interval`, or twice the
    round if longer, so that the resync takes at most a third of the operator's time. At
    5,000 jobs a round judges every job (about 1 CPU-ms each, most of it planning its world
    and parsing its spec): back to back on a loaded machine, rounds would crowd out the
    reconciles of the jobs that changed."""
    return max(interval, 2 * took)


def idle(job: KubeObject, acts: Actions) -> bool:
    """Whether `acts` would leave `job` as it is: no status change, nothing made or deleted,
    no Event."""
    return acts.status == (job.get("status") or {}) and not (
        acts.create or acts.delete or acts.events or acts.delete_job or acts.end_group
    )


def due(cluster: Cluster, keys: list[Key], decide: Decide) -> list[Key]:
    """Those of `keys` to reconcile: the ones gone or being deleted, and the ones `decide`
    would act on as the snapshot shows them. The snapshot is read and judged a chunk of jobs
    at a time."""
    out: set[Key] = set()
    listed: set[Key] = set()
    now = datetime.now(UTC)
    for jobs in job_chunks(cluster, keys):
        listed |= jobs.keys()
        out |= {k for k, job in jobs.items() if job["metadata"].get("deletionTimestamp")}
        # A job another controller runs (MultiKueue's) the reconcile leaves at once.
        rest = [k for k in jobs if k not in out and not sch.managed_elsewhere(jobs[k])]
        for key, pods in with_pods(cluster, rest):
            try:
                if not idle(jobs[key], decide(jobs[key], pods, now)):
                    out.add(key)
            except Exception:  # the reconcile will fail the same way, and say why
                out.add(key)
    return sorted(out | (set(keys) - listed))
