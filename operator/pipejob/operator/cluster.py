"""Every Kubernetes API call the operator makes itself (kopf adds its watches, listed in
rbac.py). One method per call, plain dicts in and out, over the `kubernetes` client's
connection (configured by the kopf login handler from the kubeconfig or the pod's account)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from pipejob.core.k8s import KubeObject
from pipejob.core.scheduling import KUEUE_RETRIABLE
from pipejob.core.spec import GROUP, VERSION
from pipejob.operator.status import timestamp
from pipejob.operator.status.job_status import JobStatus

REPORTER = "pipejob-operator"
# Objects one LIST reads at most (kubectl's chunk): at 5,000 jobs a whole list of them, or of
# their pods, would be the operator's largest allocation by far (issue 60).
LIST_CHUNK = 500


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, body: str):
        self.status = status
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")


def _job_path(plural: str, namespace: str, name: str) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{plural}/{name}"


# The kinds the operator makes, by their collection's name.
PLURALS = {
    "Pod": "pods",
    "Service": "services",
    "NetworkPolicy": "networkpolicies",
    "PodGroup": "podgroups",
}


def _collection(obj: KubeObject) -> str:
    """The URL path of the collection `obj` is created in."""
    api = obj["apiVersion"]
    root = "/api/v1" if api == "v1" else f"/apis/{api}"
    return f"{root}/namespaces/{obj['metadata']['namespace']}/{PLURALS[obj['kind']]}"


def merge_patch(old: KubeObject, new: KubeObject) -> KubeObject:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`."""
    patch: KubeObject = {k: None for k in old if k not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            sub = merge_patch(before, value)
            if sub:
                patch[key] = sub
        elif value != before or key not in old:
            patch[key] = value
    return patch


class Cluster:
    def __init__(self, api: client.ApiClient | None = None):
        self._api = api

    @property
    def api(self) -> client.ApiClient:
        # Made on first use: kopf runs the startup handlers (which make this object) before
        # its login handler configures the client; a client made earlier has no host.
        if self._api is None:
            self._api = client.ApiClient()
        return self._api

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str | int] | None = None,
        content_type: str = "application/json",
    ) -> KubeObject:
        params = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query,
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*params, _request_timeout=30)
        data = response.read()
        if not 200 <= response.status < 300:
            raise ApiError(response.status, method, path, data.decode("utf-8", "replace"))
        return json.loads(data) if data else {}

    def get_job(self, plural: str, namespace: str, name: str) -> KubeObject | None:
        """GET the job; None once it is gone."""
        try:
            return self._call("GET", _job_path(plural, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list_pods(self, namespace: str, job: str | list[str]) -> list[KubeObject]:
        """LIST the pods labelled with the job (every restart, every owner), or with any of
        the jobs of a list."""
        from pipejob.operator.kube import JOB_LABEL

        names = {job} if isinstance(job, str) else set(job)
        selector = (
            f"{JOB_LABEL}={job}" if isinstance(job, str) else f"{JOB_LABEL} in ({','.join(job)})"
        )
        found = self._call(
            "GET", f"/api/v1/namespaces/{namespace}/pods", query={"labelSelector": selector}
        )
        items = found.get("items") or []
        # The selector is the server's job; checking it again costs nothing and keeps a
        # server that ignores it from handing us other jobs' pods.
        return [p for p in items if (p["metadata"].get("labels") or {}).get(JOB_LABEL) in names]

    def list_jobs(self, kind: str, plural: str, namespace: str) -> Iterator[list[KubeObject]]:
        """LIST the jobs of one kind in `namespace`, `LIST_CHUNK` at a time (the API server's
        `limit` and `continue`), each with its kind and apiVersion (a list's items carry
        neither): one chunk is held at a time, never every job of the cluster."""
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{plural}"
        header = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind}
        token = ""
        while True:
            query = {"limit": str(LIST_CHUNK)} | ({"continue": token} if token else {})
            found = self._call("GET", path, query=query)
            yield [header | item for item in found.get("items") or []]
            token = (found.get("metadata") or {}).get("continue") or ""
            if not token:
                return

    def create(self, obj: KubeObject) -> bool:
        """CREATE a Pod or Service; False if one of that name exists already."""
        try:
            self._call("POST", _collection(obj), obj)
        except ApiError as e:
            if e.status == 409:
                return False
            raise
        return True

    def apply(self, obj: KubeObject) -> None:
        """CREATE one of the world's first objects (its NetworkPolicy, its PodGroup); if one
        of that name exists, PATCH its spec to this one (an edited spec, or the operator's
        settings, may have changed it), provided it is the job's: the JSON patch tests the
        owner's uid first, so another's object is refused (HTTP 422), never overwritten."""
        base = _collection(obj)
        try:
            self._call("POST", base, obj)
        except ApiError as e:
            if e.status != 409:
                raise
            owner = obj["metadata"]["ownerReferences"][0]["uid"]
            patch = [
                {"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": owner},
                {"op": "replace", "path": "/spec", "value": obj["spec"]},
            ]
            self._call(
                "PATCH",
                f"{base}/{obj['metadata']['name']}",
                patch,
                content_type="application/json-patch+json",
            )

    def end_kueue_group(self, pod: KubeObject) -> None:
        """PATCH kueue.x-k8s.io/retriable-in-group=false onto a pod: Kueue then finishes its
        group once no pod of it is active, instead of waiting for replacements."""
        meta = pod["metadata"]
        patch = {"metadata": {"annotations": {KUEUE_RETRIABLE: "false"}}}
        try:
            self._call(
                "PATCH",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                patch,
                content_type="application/merge-patch+json",
            )
        except ApiError as e:
            if e.status != 404:  # gone already: nothing left to end
                raise

    def delete_pod(self, pod: KubeObject) -> None:
        """DELETE the pod observed, not a newer one of the same name; gone already is fine."""
        meta = pod["metadata"]
        body = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if meta.get("uid"):
            body["preconditions"] = {"uid": meta["uid"]}
        try:
            self._call(
                "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body
            )
        except ApiError as e:
            if e.status not in (404, 409):
                raise

    def patch_status(self, plural: str, job: KubeObject, status: JobStatus) -> None:
        """PATCH the job's status subresource from what it was to `status`."""
        meta = job["metadata"]
        patch = merge_patch(job.get("status") or {}, status)
        if not patch:
            return
        try:
            self._call(
                "PATCH",
                _job_path(plural, meta["namespace"], meta["name"]) + "/status",
                {"status": patch},
                content_type="application/merge-patch+json",
            )
        except ApiError as e:
            if e.status != 404:  # the job was deleted while we looked at it: nothing to say
                raise

    def delete_job(self, plural: str, job: KubeObject) -> None:
        """DELETE the job (its pods and Service follow by their ownerReferences)."""
        meta = job["metadata"]
        body = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": "Background",
            "preconditions": {"uid": meta["uid"]},
        }
        try:
            self._call("DELETE", _job_path(plural, meta["namespace"], meta["name"]), body)
        except ApiError as e:
            if e.status not in (404, 409):
                raise

    def post_event(self, job: KubeObject, type: str, reason: str, message: str) -> None:
        """CREATE an Event about the job (what `kubectl describe` shows)."""
        meta = job["metadata"]
        now = datetime.now(UTC)
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            # Named as client-go names Events: the object's name and a nanosecond stamp.
            "metadata": {
                "name": f"{meta['name']}.{time.time_ns():x}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": job.get("apiVersion"),
                "kind": job.get("kind"),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": type,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": REPORTER},
            "reportingComponent": REPORTER,
            "reportingInstance": REPORTER,
            "firstTimestamp": timestamp(now),
            "lastTimestamp": timestamp(now),
            "count": 1,
        }
        self._call("POST", f"/api/v1/namespaces/{meta['namespace']}/events", event)
