"""The operator forgets a deleted job: what the reconciler keeps per job (the jobs it tracks,
those training, a lock and a queued reconcile per job, the phase gauge's entry) is emptied
when its jobs go, by their DELETED events or by a reconcile that finds a job gone, so its
memory does not grow with the jobs it has seen (issue 60). In process, against the suite's
API server, with the reconciler the operator runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes import config

from harness import jobs
from harness.cluster import Cluster
from pipejob.operator.cluster import Cluster as Kube
from pipejob.operator.controller import Reconciler
from pipejob.operator.operator_metrics import OperatorMetrics

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[1]
NS = "default"


def manifest(name: str, kind: str) -> dict:
    spec = {"steps": 3, "stages": 2} if kind == "PipelineJob" else {"steps": 3, "trainers": 1}
    return {"apiVersion": "pipejob.dev/v1alpha1", "kind": kind, "metadata": {"name": name}} | {
        "spec": spec
    }


def state(reconciler: Reconciler) -> dict[str, int]:
    """How many entries each per-job map of the reconciler holds."""
    return {
        "jobs": len(reconciler.jobs),
        "training": len(reconciler.training),
        "locks": len(reconciler._locks),
        "queued": len(reconciler.queue),
        "phases": len(reconciler.metrics._phases),
    }


def test_the_state_kept_per_job_is_emptied_when_the_jobs_are_deleted(tmp_path) -> None:
    with Cluster(tmp_path) as c:
        for path in sorted((REPO / "crds").glob("*.yaml")):
            jobs.apply_crd(c.api, yaml.safe_load(path.read_text()))
        kube = Kube(config.new_client_from_config(str(c.kubeconfig)))
        reconciler = Reconciler(kube, "img", OperatorMetrics())
        made = {f"j{i}": manifest(f"j{i}", ("PipelineJob", "HybridJob")[i % 2]) for i in range(4)}
        keys = [(jobs.resource(m["kind"]).rsplit("/", 1)[1], NS, n) for n, m in made.items()]
        for m in made.values():
            jobs.create(c.api, m, NS)

        reconciler.start(4)
        for key in keys * 2:  # a job's events and its pods', as kopf's handlers queue them
            reconciler.track(key)
            reconciler.enqueue(key, new=True)
            reconciler.enqueue(key)
        assert reconciler.queue.drained(45)
        assert all(jobs.pods(c.api, n, NS) for n in made)  # the reconciles made the worlds
        assert state(reconciler)["jobs"] == 4 and state(reconciler)["phases"] == 4
        for name, m in made.items():
            c.api.delete(jobs.resource(m["kind"]), name, NS)
        for key in keys[:2]:  # their DELETED events
            reconciler.forget(key)
        for key in keys[2:]:  # the others found gone by a resync
            reconciler.enqueue(key, poll=True)
        assert reconciler.queue.drained(45)
        reconciler.stop()
        assert state(reconciler) == dict.fromkeys(state(reconciler), 0)
