"""The resync reads the cluster once (a LIST of each kind's jobs, one of pods per 100 jobs) and
reconciles afresh only the jobs it would act on: the rest cost the API server nothing more
(issue 60, at 1,000 jobs the resync's reads set the pace), its jobs in chunks. A missed
event, a job gone or failing is still found. In process, against the suite's API server."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes import config

from harness import jobs
from harness.cluster import Cluster
from pipejob.operator import cluster, resync
from pipejob.operator.cluster import Cluster as Kube
from pipejob.operator.controller import Reconciler
from pipejob.operator.operator_metrics import OperatorMetrics

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[1]
NS = "default"


class Counted(Kube):
    """The operator's API calls, each one counted on its way out."""

    calls: list[tuple[str, str]]

    def _call(self, method: str, path: str, *args, **kwargs) -> dict:
        self.calls.append((method, path))
        return super()._call(method, path, *args, **kwargs)


def manifest(i: int) -> dict:
    kind = ("PipelineJob", "HybridJob")[i % 2]
    spec = {"steps": 3, "stages": 2} if kind == "PipelineJob" else {"steps": 3, "trainers": 1}
    return {"apiVersion": "pipejob.dev/v1alpha1", "kind": kind, "metadata": {"name": f"j{i}"}} | {
        "spec": spec
    }


LONG_RUNNING = {"name": "trainer", "state": {"running": {"startedAt": "2020-01-01T00:00:00Z"}}}


def running(c: Cluster, reconciler: Reconciler, keys: list) -> None:
    """Reconcile each job to its world, mark every pod Running (as a kubelet would), and
    reconcile again: every job Running, nothing left to do. A PipelineJob's master is made
    first, and its others once it has run unread long enough (master_check.UNREAD_SECONDS:
    here no master serves /progress), so twice."""
    for key in keys:
        reconciler.track(key)
        reconciler.kick(key)
    for _ in range(2):
        for pod in c.api.list("v1/pods", NS):
            status = {"status": {"phase": "Running", "containerStatuses": [LONG_RUNNING]}}
            c.api.patch("v1/pods", pod["metadata"]["name"], status, NS, subresource="status")
        for key in keys:
            reconciler.kick(key)
        job = jobs.get(c.api, ("PipelineJob", "HybridJob")[int(key[2][1:]) % 2], key[2])
        assert job["status"]["phase"] == "Running", job["status"]


def test_a_long_round_is_followed_by_a_longer_pause() -> None:
    assert resync.pause(10.0, 0.5) == 10.0
    assert resync.pause(10.0, 8.0) == 16.0  # the resync at most a third of the time


def test_a_resync_reads_the_cluster_once_and_reconciles_only_the_jobs_it_would_act_on(
    tmp_path, monkeypatch
) -> None:
    with Cluster(tmp_path) as c:
        for path in sorted((REPO / "crds").glob("*.yaml")):
            jobs.apply_crd(c.api, yaml.safe_load(path.read_text()))
        kube = Counted(config.new_client_from_config(str(c.kubeconfig)))
        kube.calls = []
        reconciler = Reconciler(kube, "img", OperatorMetrics())
        made = [manifest(i) for i in range(6)]
        keys = [
            (jobs.resource(m["kind"]).rsplit("/", 1)[1], NS, m["metadata"]["name"]) for m in made
        ]
        for m in made:
            jobs.create(c.api, m, NS)
        running(c, reconciler, keys)

        kube.calls.clear()
        assert reconciler.due() == []  # all as they should be
        assert sorted(m for m, _ in kube.calls) == ["GET"] * 4  # each kind's jobs, their pods
        monkeypatch.setattr(resync, "CHUNK", 4)  # the pods of at most 4 jobs in one LIST
        kube.calls.clear()
        assert reconciler.due() == []
        assert [p.rsplit("/", 1)[1] for _, p in kube.calls].count("pods") == 2
        monkeypatch.setattr(cluster, "LIST_CHUNK", 2)  # at most 2 jobs in one LIST's answer
        kube.calls.clear()
        assert reconciler.due() == []
        listed = [p.rsplit("/", 1)[1] for _, p in kube.calls]
        assert listed.count("pipelinejobs") == listed.count("hybridjobs") == 2  # 3 of each

        # What the operator's watches might have missed: a pod gone, a member failed, a job
        # deleted. Each of those jobs is due, and only those.
        c.api.delete("v1/pods", "j0-stage-1", NS)
        failed = {"status": {"phase": "Failed"}}
        c.api.patch("v1/pods", "j3-trainer-0", failed, NS, subresource="status")
        c.api.delete(jobs.resource("PipelineJob"), "j4", NS)
        assert reconciler.due() == sorted([keys[0], keys[3], keys[4]])
