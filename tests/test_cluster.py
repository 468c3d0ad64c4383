"""The operator's own API calls (cluster.py) over real HTTP on loopback: their paths, bodies
and error handling, and that rbac.py grants each of them."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from pipejob.operator import rbac
from pipejob.operator.cluster import ApiError, Cluster, merge_patch

pytestmark = pytest.mark.timeout(30)

JOB = {
    "apiVersion": "pipejob.dev/v1alpha1",
    "kind": "PipelineJob",
    "metadata": {"name": "j", "namespace": "ns", "uid": "u1"},
    "status": {"phase": "Running", "restarts": 0, "startTime": "t"},
}
POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "j-master-0", "namespace": "ns", "uid": "p1"},
}
OWNER = {
    "apiVersion": "pipejob.dev/v1alpha1",
    "kind": "PipelineJob",
    "name": "j",
    "uid": "u1",
    "controller": True,
    "blockOwnerDeletion": True,
}
POLICY = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "j", "namespace": "ns", "ownerReferences": [OWNER]},
    "spec": {"podSelector": {"matchLabels": {"pipejob.dev/job": "j"}}},
}
POLICIES = "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies"


class Recorder(BaseHTTPRequestHandler):
    """Answers every request from `replies` ((method, path) -> (status, body)), else 200 {}."""

    requests: list = []
    replies: dict = {}

    def _serve(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        url = urlparse(self.path)
        self.requests.append(
            {
                "method": self.command,
                "path": url.path,
                "query": parse_qs(url.query),
                "type": self.headers.get("Content-Type"),
                "body": body,
            }
        )
        status, reply = self.replies.get((self.command, url.path), (200, {}))
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_DELETE = _serve

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Recorder.requests, Recorder.replies = [], {}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    config = client.Configuration(host=f"http://127.0.0.1:{httpd.server_port}")
    try:
        yield Cluster(client.ApiClient(config)), Recorder
    finally:
        httpd.shutdown()
        httpd.server_close()


def permission(request) -> tuple[str, str, str]:
    """(group, resource, verb) of a request, as RBAC sees it."""
    parts = request["path"].strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    assert rest[0] == "namespaces"
    resource, named = rest[2], len(rest) > 3
    if len(rest) > 4:
        resource += "/" + rest[4]
    verb = {
        "GET": "get" if named else "list",
        "POST": "create",
        "PATCH": "patch",
        "DELETE": "delete",
    }[request["method"]]
    return group, resource, verb


def test_every_call_is_granted_by_rbac(server):
    cluster, rec = server
    rec.replies[("GET", "/api/v1/namespaces/ns/pods")] = (200, {"items": []})
    cluster.get_job("pipelinejobs", "ns", "j")
    cluster.list_pods("ns", "j")
    cluster.list_pods("ns", ["j", "k"])  # the resync's: a hundred jobs' at a time
    list(cluster.list_jobs("PipelineJob", "pipelinejobs", "ns"))
    cluster.create(POD)
    cluster.create(
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "j", "namespace": "ns"}}
    )
    rec.replies[("POST", POLICIES)] = (409, {"reason": "AlreadyExists"})
    cluster.apply(POLICY)  # exists: patched
    cluster.delete_pod(POD)
    cluster.patch_status("hybridjobs", dict(JOB, kind="HybridJob"), {"phase": "Failed"})
    cluster.delete_job("pipelinejobs", JOB)
    cluster.post_event(JOB, "Normal", "Created", "made")
    made = {permission(r) for r in rec.requests}
    assert made == {
        ("pipejob.dev", "pipelinejobs", "get"),
        ("pipejob.dev", "pipelinejobs", "list"),
        ("", "pods", "list"),
        ("", "pods", "create"),
        ("", "services", "create"),
        ("networking.k8s.io", "networkpolicies", "create"),
        ("networking.k8s.io", "networkpolicies", "patch"),
        ("", "pods", "delete"),
        ("pipejob.dev", "hybridjobs/status", "patch"),
        ("pipejob.dev", "pipelinejobs", "delete"),
        ("", "events", "create"),
    }
    assert made <= rbac.grants() | rbac.grants(rbac.NETWORK_POLICIES)


def test_an_existing_object_of_the_world_is_patched_only_if_it_is_the_jobs(server):
    cluster, rec = server
    cluster.apply(POLICY)
    assert [(r["method"], r["path"], r["body"]) for r in rec.requests] == [
        ("POST", POLICIES, POLICY)
    ]
    rec.replies[("POST", POLICIES)] = (409, {"reason": "AlreadyExists"})
    rec.replies[("PATCH", f"{POLICIES}/j")] = (422, {"message": "the test operation failed"})
    with pytest.raises(ApiError, match="HTTP 422"):  # another's: never overwritten
        cluster.apply(POLICY)
    patch = rec.requests[-1]
    assert patch["type"] == "application/json-patch+json"
    assert patch["body"] == [
        {"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": "u1"},
        {"op": "replace", "path": "/spec", "value": POLICY["spec"]},
    ]


def test_list_pods_selects_by_job_label_and_trusts_no_one(server):
    cluster, rec = server
    mine = {"metadata": {"name": "a", "labels": {"pipejob.dev/job": "j"}}}
    other = {"metadata": {"name": "b", "labels": {"pipejob.dev/job": "k"}}}
    rec.replies[("GET", "/api/v1/namespaces/ns/pods")] = (200, {"items": [mine, other]})
    assert cluster.list_pods("ns", "j") == [mine]
    assert rec.requests[0]["query"] == {"labelSelector": ["pipejob.dev/job=j"]}
    assert cluster.list_pods("ns", ["j", "k"]) == [mine, other]  # several jobs'
    assert rec.requests[1]["query"] == {"labelSelector": ["pipejob.dev/job in (j,k)"]}


def test_status_is_a_merge_patch_of_the_difference(server):
    cluster, rec = server
    cluster.patch_status("pipelinejobs", JOB, {"phase": "Suspended", "restarts": 0})
    (req,) = rec.requests
    assert req["path"] == "/apis/pipejob.dev/v1alpha1/namespaces/ns/pipelinejobs/j/status"
    assert req["type"] == "application/merge-patch+json"
    assert req["body"] == {"status": {"phase": "Suspended", "startTime": None}}
    cluster.patch_status("pipelinejobs", JOB, JOB["status"])
    assert len(rec.requests) == 1  # nothing changed: no call


def test_already_there_and_already_gone_are_fine(server):
    cluster, rec = server
    rec.replies[("POST", "/api/v1/namespaces/ns/pods")] = (409, {"reason": "AlreadyExists"})
    rec.replies[("DELETE", "/api/v1/namespaces/ns/pods/j-master-0")] = (404, {})
    rec.replies[("GET", "/apis/pipejob.dev/v1alpha1/namespaces/ns/pipelinejobs/j")] = (404, {})
    assert cluster.create(POD) is False
    cluster.delete_pod(POD)
    assert cluster.get_job("pipelinejobs", "ns", "j") is None
    delete = rec.requests[1]
    assert delete["body"]["preconditions"] == {"uid": "p1"}  # never a newer pod of that name


def test_other_errors_are_raised_with_what_was_asked(server):
    cluster, rec = server
    rec.replies[("POST", "/api/v1/namespaces/ns/pods")] = (403, {"message": "forbidden"})
    with pytest.raises(ApiError, match=r"POST /api/v1/namespaces/ns/pods: HTTP 403"):
        cluster.create(POD)


def test_merge_patch():
    old = {"a": 1, "b": {"x": 1, "y": 2}, "c": [1], "d": 4}
    new = {"a": 1, "b": {"x": 1, "z": 3}, "c": [1, 2]}
    assert merge_patch(old, new) == {"b": {"y": None, "z": 3}, "c": [1, 2], "d": None}
    assert merge_patch(new, new) == {}
