"""The test harness itself, with hand-made objects: the API server emulator keeps the promises
the operator tests rely on, and the process-kubelet runs pods as real processes."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

import pytest

from harness.client import JSON_PATCH, TABLE, ApiError
from harness.cluster import Cluster
from harness.kubelet import Kubelet
from harness.netpolicy import NAMESPACE_LABEL, Endpoint, rules
from harness.selectors import label_selector

NS = "default"
PODS = "v1/pods"
SERVICES = "v1/services"
CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"


def pod(name: str, code: str = "", labels: dict | None = None, **spec) -> dict:
    """A pod whose container runs `python -c code`."""
    container = {"name": "main", "image": "python", "command": ["python", "-c", code or "pass"]}
    container |= spec.pop("container", {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def status(cluster: Cluster, name: str) -> dict:
    return cluster.api.get(PODS, name, NS).get("status", {})


def finished(cluster: Cluster, name: str, timeout: float = 20) -> dict:
    return cluster.api.wait(
        f"pod {name} to finish",
        lambda: (
            status(cluster, name)
            if status(cluster, name).get("phase") in ("Succeeded", "Failed")
            else None
        ),
        timeout,
    )


def terminated(pod_status: dict) -> dict:
    return pod_status["containerStatuses"][0]["state"]["terminated"]


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- the API server -------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_objects_are_stamped_and_names_generated(cluster):
    api = cluster.api
    a = api.create(PODS, pod("a"), NS)
    b = api.create(PODS, {"metadata": {"generateName": "b-"}, "spec": {}}, NS)
    meta = a["metadata"]
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z") and meta["generation"] == 1
    assert meta["namespace"] == NS and a["kind"] == "Pod" and a["status"] == {"phase": "Pending"}
    assert b["metadata"]["name"].startswith("b-") and len(b["metadata"]["name"]) == 7
    assert int(b["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    with pytest.raises(ApiError) as e:
        api.create(PODS, pod("a"), NS)
    assert e.value.status == 409
    listed = api.request("GET", "/api/v1/namespaces/default/pods")
    assert listed["kind"] == "PodList"
    assert int(listed["metadata"]["resourceVersion"]) >= int(b["metadata"]["resourceVersion"])


@pytest.mark.timeout(30)
def test_status_subresource_is_isolated(cluster):
    api = cluster.api
    api.create(PODS, pod("p", labels={"x": "1"}), NS)
    both = {"status": {"phase": "Running"}, "metadata": {"labels": {"x": "2"}}}
    main = api.patch(PODS, "p", both, NS)
    assert main["status"] == {"phase": "Pending"} and main["metadata"]["labels"] == {"x": "2"}
    both["metadata"]["labels"]["x"] = "3"
    sub = api.patch(PODS, "p", both, NS, subresource="status")
    assert sub["status"] == {"phase": "Running"} and sub["metadata"]["labels"] == {"x": "2"}
    assert sub["metadata"]["generation"] == 1  # neither touched the spec


@pytest.mark.timeout(30)
def test_patch_semantics(cluster):
    api = cluster.api
    created = api.create(
        SERVICES,
        {"metadata": {"name": "s", "labels": {"a": "1", "b": "2"}}, "spec": {"clusterIP": "None"}},
        NS,
    )
    rv = created["metadata"]["resourceVersion"]
    same = api.patch(SERVICES, "s", {"metadata": {"labels": {"a": "1"}}}, NS)
    assert same["metadata"]["resourceVersion"] == rv  # a no-op write is no write
    changed = api.patch(SERVICES, "s", {"metadata": {"labels": {"b": None}}, "spec": {"x": 1}}, NS)
    assert changed["metadata"]["labels"] == {"a": "1"} and changed["metadata"]["generation"] == 2
    stale = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/metadata/finalizers", "value": ["f"]},
    ]
    with pytest.raises(ApiError) as e:  # kopf's optimistic concurrency relies on this 422
        api.patch(SERVICES, "s", stale, NS, content_type=JSON_PATCH)
    assert e.value.status == 422
    with pytest.raises(ApiError) as e:
        api.patch(SERVICES, "s", {"metadata": {"resourceVersion": rv}}, NS)
    assert e.value.status == 409


@pytest.mark.timeout(30)
def test_label_and_field_selectors(cluster):
    api = cluster.api
    labelled = [
        ("a", {"job": "j", "role": "master"}),
        ("b", {"job": "j", "role": "stage"}),
        ("c", {"job": "k"}),
        ("d", {}),
    ]
    for name, labels in labelled:
        api.create(PODS, pod(name, labels=labels), NS)

    def select(**params) -> list[str]:
        return sorted(p["metadata"]["name"] for p in api.list(PODS, NS, **params))

    assert select(labelSelector="job=j") == ["a", "b"]
    assert select(labelSelector="job==j,role!=master") == ["b"]
    assert select(labelSelector="job in (j, k),!role") == ["c"]
    assert select(labelSelector="role notin (stage)") == ["a", "c", "d"]
    assert select(labelSelector="job") == ["a", "b", "c"]
    assert select(fieldSelector="metadata.name=d") == ["d"]
    assert select(fieldSelector="metadata.name!=d", labelSelector="!job") == []
    with pytest.raises(ApiError) as e:
        select(labelSelector="job in j")
    assert e.value.status == 400


@pytest.mark.timeout(60)
def test_a_list_by_label_answers_as_the_walk_of_every_object(cluster):
    """A selector that pins a label is served from the label index: the same objects, in the
    same order, as the selector applied to the whole list, through relabelling, deletion, a
    name reused, and another namespace."""
    api = cluster.api
    for i in range(12):
        api.create(PODS, pod(f"p{i}", labels={"job": f"j{i % 3}", "role": f"r{i % 2}"}), NS)
    api.create(PODS, pod("other", labels={"job": "j0"}), "other")
    api.patch(PODS, "p0", {"metadata": {"labels": {"job": "j2", "role": None}}}, NS)
    api.patch(PODS, "p4", {"metadata": {"labels": {"extra": "x"}}}, NS)
    api.delete(PODS, "p3", NS)
    api.delete(PODS, "p5", NS)
    api.create(PODS, pod("p3", labels={"job": "j1"}), NS)  # a reused name keeps its place
    api.create(PODS, pod("p12", labels={"job": "j1", "role": 7}), NS)  # not a string: no match
    selectors = [
        "job=j0",
        "job==j1,role=r1",
        "job in (j0, j2)",
        "job in (j1),role notin (r0)",
        "job=j2,!role",
        "job=j0,job=j1",
        "role=r0,extra",
        "job=nobody",
        "role=7",
    ]
    everything = api.list(PODS, NS)
    for text in selectors:
        walked = [p["metadata"]["name"] for p in everything if label_selector(text)(p)]
        indexed = [p["metadata"]["name"] for p in api.list(PODS, NS, labelSelector=text)]
        assert indexed == walked, text
    assert [p["metadata"]["name"] for p in api.list(PODS, None, labelSelector="job=j0")] == [
        p["metadata"]["name"] for p in api.list(PODS, None) if label_selector("job=j0")(p)
    ]


@pytest.mark.timeout(30)
def test_a_list_comes_in_chunks_of_its_limit(cluster):
    api = cluster.api
    for name in ("e", "b", "d", "a", "c"):
        api.create(PODS, pod(name, labels={"job": "j"}), NS)
    api.create(PODS, pod("x"), NS)
    names, token, versions = [], None, set()
    while token != "":
        params = {"labelSelector": "job", "limit": "2"} | ({"continue": token} if token else {})
        found = api.request("GET", f"/api/v1/namespaces/{NS}/pods", params=params)
        assert len(found["items"]) <= 2
        names += [p["metadata"]["name"] for p in found["items"]]
        token = found["metadata"]["continue"]
        versions.add(found["metadata"]["resourceVersion"])
        if len(names) == 2:  # made between the chunks: a later chunk has it
            api.create(PODS, pod("f", labels={"job": "j"}), NS)
    assert names == ["a", "b", "c", "d", "e", "f"]
    assert len(versions) == 1  # the first chunk's, for a watch from it to replay what changed
    assert len(api.list(PODS, NS)) == 7  # no limit: all at once
    with pytest.raises(ApiError) as e:
        api.list(PODS, NS, limit="two")
    assert e.value.status == 400


@pytest.mark.timeout(30)
def test_watch_filters_and_replays_from_a_resource_version(cluster):
    api = cluster.api
    api.create(PODS, pod("old", labels={"job": "j"}), NS)
    mark = api.request("GET", "/api/v1/namespaces/default/pods")["metadata"]["resourceVersion"]
    api.delete(PODS, "old", NS)  # happens between a list and a watch: must not be lost
    api.create(PODS, pod("other", labels={"job": "k"}), NS)
    watch = api.watch(PODS, NS, labelSelector="job=j", resourceVersion=mark, timeoutSeconds="2")
    seen: list[tuple[str, str]] = []
    reader = threading.Thread(
        target=lambda: seen.extend((e["type"], e["object"]["metadata"]["name"]) for e in watch)
    )
    reader.start()
    api.create(PODS, pod("new", labels={"job": "j"}), NS)
    reader.join(10)  # the server ends the watch after timeoutSeconds
    assert not reader.is_alive()
    assert seen == [("DELETED", "old"), ("ADDED", "new")]


@pytest.mark.timeout(30)
def test_deleting_an_owner_deletes_its_dependents_and_nothing_else(cluster):
    api = cluster.api
    owner = api.create(SERVICES, {"metadata": {"name": "owner"}, "spec": {}}, NS)
    ref = {"apiVersion": "v1", "kind": "Service", "name": "owner", "uid": owner["metadata"]["uid"]}
    child = api.create(SERVICES, {"metadata": {"name": "child", "ownerReferences": [ref]}}, NS)
    grandchild = pod("grandchild")
    grandchild["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Service", "name": "child", "uid": child["metadata"]["uid"]}
    ]
    api.create(PODS, grandchild, NS)
    api.create(PODS, pod("bystander"), NS)
    api.delete(SERVICES, "owner", NS)
    assert [s["metadata"]["name"] for s in api.list(SERVICES, NS)] == []
    assert [p["metadata"]["name"] for p in api.list(PODS, NS)] == ["bystander"]
    orphan = pod("late")  # made after its owner went: collected at once
    orphan["metadata"]["ownerReferences"] = [ref]
    api.create(PODS, orphan, NS)
    assert api.find(PODS, "late", NS) is None


@pytest.mark.timeout(30)
def test_a_dependent_goes_with_the_owner_its_references_name_now(cluster):
    """The garbage collector reads the owners' dependents from an index: a dependent whose
    references were rewritten (adopted by another owner) goes with the new owner only."""
    api = cluster.api

    def ref(owner: dict) -> dict:
        meta = owner["metadata"]
        return {"apiVersion": "v1", "kind": "Service", "name": meta["name"], "uid": meta["uid"]}

    a, b = (api.create(SERVICES, {"metadata": {"name": n}, "spec": {}}, NS) for n in "ab")
    moved = pod("moved")
    moved["metadata"]["ownerReferences"] = [ref(a)]
    api.create(PODS, moved, NS)
    api.patch(PODS, "moved", {"metadata": {"ownerReferences": [ref(b)]}}, NS)
    api.delete(SERVICES, "a", NS)
    assert api.find(PODS, "moved", NS) is not None
    api.delete(SERVICES, "b", NS)
    assert api.find(PODS, "moved", NS) is None


@pytest.mark.timeout(30)
def test_finalizers_preconditions_and_deletecollection(cluster):
    api = cluster.api
    held = api.create(SERVICES, {"metadata": {"name": "held", "finalizers": ["x/y"]}}, NS)
    with pytest.raises(ApiError) as e:
        api.request(
            "DELETE",
            "/api/v1/namespaces/default/services/held",
            {"preconditions": {"uid": "someone-else"}},
        )
    assert e.value.status == 409
    marked = api.delete(SERVICES, "held", NS)
    assert marked["metadata"]["deletionTimestamp"] and api.find(SERVICES, "held", NS)
    api.patch(SERVICES, "held", {"metadata": {"finalizers": None}}, NS)
    assert api.find(SERVICES, "held", NS) is None and held
    for name in "abc":
        api.create(PODS, pod(name, labels={"group": "x" if name != "c" else "y"}), NS)
    gone = api.delete(PODS, None, NS, labelSelector="group=x")
    assert sorted(p["metadata"]["name"] for p in gone["items"]) == ["a", "b"]
    assert [p["metadata"]["name"] for p in api.list(PODS, NS)] == ["c"]


def test_writes_naming_a_uid_leave_a_recreated_pod_of_that_name_alone(cluster):
    """A kubelet's writes name the pod's uid: once the pod is deleted and created again under
    its name (a restarted world), a late status, binding or deletion of the old one is a
    Conflict and the new pod is untouched."""
    api = cluster.api
    old = api.create(PODS, pod("p"), NS)["metadata"]["uid"]
    api.delete(PODS, "p", NS, {"gracePeriodSeconds": 0})
    new = api.create(PODS, pod("p"), NS)["metadata"]["uid"]
    writes = [
        lambda: api.patch(
            PODS,
            "p",
            {"metadata": {"uid": old}, "status": {"phase": "Failed"}},
            NS,
            subresource="status",
        ),
        lambda: api.request(
            "POST",
            "/api/v1/namespaces/default/pods/p/binding",
            {"metadata": {"name": "p", "uid": old}, "target": {"kind": "Node", "name": "n"}},
        ),
        lambda: api.delete(PODS, "p", NS, {"gracePeriodSeconds": 0, "preconditions": {"uid": old}}),
    ]
    for write in writes:
        with pytest.raises(ApiError) as e:
            write()
        assert e.value.status == 409
    same = api.get(PODS, "p", NS)
    assert same["metadata"]["uid"] == new and same.get("status", {}).get("phase") != "Failed"
    assert not same["spec"].get("nodeName")


@pytest.mark.timeout(30)
def test_a_crd_serves_its_resource_with_discovery_and_tables(cluster):
    api = cluster.api
    with pytest.raises(ApiError) as e:
        api.list("example.dev/v1/widgets", NS)
    assert e.value.status == 404
    crd = api.create(
        CRDS,
        {
            "metadata": {"name": "widgets.example.dev"},
            "spec": {
                "group": "example.dev",
                "scope": "Namespaced",
                "names": {
                    "kind": "Widget",
                    "plural": "widgets",
                    "singular": "widget",
                    "shortNames": ["wd"],
                    "categories": ["toys"],
                },
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "subresources": {"status": {}},
                        "schema": {"openAPIV3Schema": {"type": "object"}},
                        "additionalPrinterColumns": [
                            {"name": "Color", "type": "string", "jsonPath": ".spec.color"},
                            {
                                "name": "Age",
                                "type": "date",
                                "jsonPath": ".metadata.creationTimestamp",
                            },
                        ],
                    }
                ],
            },
        },
    )
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"
    discovery = api.request("GET", "/apis/example.dev/v1")
    served = {r["name"]: r for r in discovery["resources"]}
    assert served["widgets"]["shortNames"] == ["wd"] and served["widgets"]["namespaced"]
    assert "widgets/status" in served
    api.create(
        "example.dev/v1/widgets",
        {"metadata": {"name": "w"}, "spec": {"color": "red"}, "status": {"ignored": True}},
        NS,
    )
    assert "status" not in api.get("example.dev/v1/widgets", "w", NS)
    url = "/apis/example.dev/v1/namespaces/default/widgets"
    assert api.request("GET", url)["kind"] == "WidgetList"
    table = api.request("GET", url, accept=TABLE)
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Color", "Age"]
    assert table["rows"][0]["cells"][:2] == ["w", "red"]
    assert table["rows"][0]["cells"][2].endswith("s")  # an age like "0s"


# --- the process-kubelet --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_pods_run_as_processes_and_report_their_exit(cluster, kubelet):
    api = cluster.api
    api.create(PODS, pod("ok", "print('hello from the pod')"), NS)
    code = "import sys; print('about to fail'); sys.exit(3)"
    failing = pod("bad", code, container={"terminationMessagePolicy": "FallbackToLogsOnError"})
    api.create(PODS, failing, NS)
    ok, bad = finished(cluster, "ok"), finished(cluster, "bad")
    assert ok["phase"] == "Succeeded" and terminated(ok)["exitCode"] == 0
    assert ok["podIP"].startswith("127.") and ok["startTime"]
    assert api.get(PODS, "ok", NS)["spec"]["nodeName"] == kubelet.node
    assert bad["phase"] == "Failed" and terminated(bad)["exitCode"] == 3
    assert terminated(bad)["reason"] == "Error" and "about to fail" in terminated(bad)["message"]
    assert "hello from the pod" in kubelet.logs(NS, "ok")


@pytest.mark.timeout(60)
def test_pod_dns_names_resolve_to_pod_addresses_inside_pods_only(cluster, kubelet):
    api = cluster.api
    api.create(
        SERVICES,
        {"metadata": {"name": "sub"}, "spec": {"clusterIP": "None", "selector": {"app": "x"}}},
        NS,
    )
    server = (
        "import socket; s = socket.create_server((socket.gethostname(), 7000));"
        "c, _ = s.accept(); c.sendall(socket.gethostname().encode())"
    )
    client = (
        "import socket, time\nfor _ in range(100):\n  try:\n"
        "    print(socket.create_connection(('server.sub', 7000)).recv(99).decode()); break\n"
        "  except OSError: time.sleep(0.1)\n"
        "print(socket.gethostbyname('server.sub.default.svc.cluster.local'))"
    )
    for name, code in (("server", server), ("client", client)):
        api.create(PODS, pod(name, code, labels={"app": "x"}, hostname=name, subdomain="sub"), NS)
    assert finished(cluster, "client")["phase"] == "Succeeded"
    assert finished(cluster, "server")["phase"] == "Succeeded"
    server_ip = status(cluster, "server")["podIP"]
    assert kubelet.logs(NS, "client").split() == ["server", server_ip]
    with pytest.raises(socket.gaierror):  # the names exist for the pods, not for the machine
        socket.getaddrinfo("server.sub.default.svc.cluster.local", 7000)


@pytest.mark.timeout(60)
def test_the_pod_network_is_private_and_bridged_only_where_asked(cluster, kubelet):
    api, network = cluster.api, kubelet.network
    server = (
        "import http.server, socket; http.server.HTTPServer((socket.gethostname(), 8000),"
        " http.server.SimpleHTTPRequestHandler).serve_forever()"
    )
    api.create(PODS, pod("web", server), NS)
    ip = api.wait("the pod's address", lambda: status(cluster, "web").get("podIP"), 20)

    def fetch() -> bytes | None:
        try:
            return network.get(f"http://{ip}:8000/")  # from inside, as the operator's pod would
        except OSError:
            return None

    assert b"Directory listing" in api.wait("the pod serving", fetch, 20)
    with pytest.raises(OSError):  # from the machine's own network there is nothing there
        socket.create_connection((ip, 8000), timeout=2).close()
    network.forward(cluster.port)  # the API server, where a kubeconfig points, for pods
    client = f"import urllib.request; print(urllib.request.urlopen('{cluster.url}/version').read())"
    api.create(PODS, pod("client", client), NS)
    assert finished(cluster, "client")["phase"] == "Succeeded"
    assert "gitVersion" in kubelet.logs(NS, "client")


@pytest.mark.timeout(60)
def test_env_field_refs_and_expansion(cluster, kubelet):
    env = [
        {"name": "A", "value": "x"},
        {"name": "B", "value": "$(A)-$$(A)"},
        {"name": "A", "value": "later wins"},
        {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    code = "import os; print(os.environ['A'], os.environ['B'], os.environ['ME'], os.environ['IP'])"
    spec = pod("envy", code, container={"env": env, "args": ["$(ME)"]})
    cluster.api.create(PODS, spec, NS)
    assert finished(cluster, "envy")["phase"] == "Succeeded"
    ip = status(cluster, "envy")["podIP"]
    assert kubelet.logs(NS, "envy").strip() == f"later wins x-$(A) envy {ip}"


@pytest.mark.timeout(60)
def test_kill_evict_and_graceful_delete(cluster, kubelet):
    api = cluster.api
    sleeper = "import time; print('up', flush=True); time.sleep(60)"
    for name in ("crash", "evict", "delete"):
        api.create(PODS, pod(name, sleeper), NS)
    api.wait("processes", lambda: len(kubelet.running()) == 3, 20)
    names = ("crash", "evict", "delete")
    api.wait(
        "pods running", lambda: all(status(cluster, n)["phase"] == "Running" for n in names), 20
    )
    kubelet.kill(NS, "crash")
    assert terminated(finished(cluster, "crash"))["exitCode"] == 128 + signal.SIGKILL
    kubelet.evict(NS, "evict")
    evicted = finished(cluster, "evict")
    assert (evicted["phase"], evicted["reason"]) == ("Failed", "Evicted")
    pid = kubelet.run(NS, "delete").process.pid
    terminating = api.delete(PODS, "delete", NS)
    assert terminating["metadata"]["deletionTimestamp"]  # the kubelet finishes the deletion
    api.wait("pod deleted", lambda: api.find(PODS, "delete", NS) is None, 20)
    assert not alive(pid)


@pytest.mark.timeout(60)
def test_restart_policy_restarts_in_place(cluster, kubelet):
    code = (
        "import os, sys; first = not os.path.exists('marker'); open('marker', 'w');"
        "sys.exit(1 if first else 0)"
    )
    cluster.api.create(PODS, pod("flaky", code, restartPolicy="OnFailure"), NS)
    done = finished(cluster, "flaky")
    assert done["phase"] == "Succeeded"
    assert done["containerStatuses"][0]["restartCount"] == 1
    assert done["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 1


@pytest.mark.timeout(30)
def test_pods_asking_for_what_the_node_lacks_stay_pending(cluster, kubelet):
    gpu = pod("gpu", container={"resources": {"limits": {"nvidia.com/gpu": 1}}})
    cluster.api.create(PODS, gpu, NS)
    scheduled = cluster.api.wait(
        "the scheduling verdict",
        lambda: next(
            (
                c
                for c in status(cluster, "gpu").get("conditions", [])
                if c["type"] == "PodScheduled"
            ),
            None,
        ),
        10,
    )
    assert scheduled["status"] == "False" and "nvidia.com/gpu" in scheduled["message"]
    assert status(cluster, "gpu")["phase"] == "Pending" and not kubelet.runs()


@pytest.mark.timeout(60)
def test_stopping_the_kubelet_leaves_no_process(cluster, tmp_path):
    from harness import network

    if network.unavailable():
        pytest.skip(network.unavailable())
    with Kubelet(cluster.api, tmp_path / "node2") as node:
        code = (
            "import subprocess, sys, time;"
            f"subprocess.Popen([{sys.executable!r}, '-c', 'import time; time.sleep(60)']);"
            "time.sleep(60)"
        )
        cluster.api.create(PODS, pod("parent", code), NS)
        cluster.api.wait("the process", lambda: node.running(), 20)
        pid = node.running()[0].process.pid
        cluster.api.wait("its child", lambda: _children(pid), 20)
        children = _children(pid)
    cluster.api.wait("no process left", lambda: not any(map(alive, [pid, *children])), 5)


@pytest.mark.timeout(60)
def test_a_container_ends_with_its_main_process(cluster, kubelet):
    code = (
        "import subprocess, sys;"
        f"child = subprocess.Popen([{sys.executable!r}, '-c', 'import time; time.sleep(60)']);"
        "open('child', 'w').write(str(child.pid))"
    )
    cluster.api.create(PODS, pod("orphaning", code), NS)
    assert finished(cluster, "orphaning")["phase"] == "Succeeded"
    child = int((kubelet.run(NS, "orphaning").dir / "child").read_text())
    cluster.api.wait("the orphan killed", lambda: not alive(child), 5)


def _children(pid: int) -> list[int]:
    """Every process in the process group led by `pid`, but the leader."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != pid:
            try:
                if os.getpgid(int(entry)) == pid:
                    found.append(int(entry))
            except ProcessLookupError:
                pass
    return found


def test_the_network_plugin_isolates_selected_pods_and_admits_what_their_policies_allow():
    """The container-kubelet's NetworkPolicy rules, as iptables lines: a selected pod admits
    the union of its policies' rules and drops the rest; other pods stay open; peers are
    looked for in the policy's namespace unless a namespaceSelector says otherwise."""
    a1 = Endpoint("ns", {"job": "a"}, "10.9.0.2", {"monitor": 29503})  # a named port
    a2, b = Endpoint("ns", {"job": "a"}, "10.9.0.3"), Endpoint("ns", {"job": "b"}, "10.9.0.4")
    prometheus = Endpoint("mon", {"app": "prom"}, "10.9.0.5")
    elsewhere = Endpoint("other", {"job": "a"}, "10.9.0.6")  # job a's label, another namespace
    job_a = {"podSelector": {"matchLabels": {"job": "a"}}}
    world = {
        "metadata": {"name": "a", "namespace": "ns"},
        "spec": {**job_a, "policyTypes": ["Ingress"], "ingress": [{"from": [job_a]}]},
    }
    monitor = {
        "metadata": {"name": "m", "namespace": "ns"},
        "spec": {
            **job_a,
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "mon"}},
                            "podSelector": {
                                "matchExpressions": [{"key": "app", "operator": "Exists"}]
                            },
                        }
                    ],
                    "ports": [{"protocol": "TCP", "port": "monitor"}],
                }
            ],
        },
    }
    lines = rules([world, monitor], [a1, a2, b, prometheus, elsewhere], "PJ-x")
    head = [
        "-A PJ-x -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN",
        "-A PJ-x -j PJ-x-IN",
        "-A PJ-x -j PJ-x-OUT",
    ]
    world_a = [
        f"-A PJ-x-IN -d {pod.address}/32 -s {peer.address}/32 -j RETURN"
        for pod in (a1, a2)
        for peer in (a1, a2)
    ]
    assert lines == [
        *head,
        *world_a[:2],
        "-A PJ-x-IN -d 10.9.0.2/32 -s 10.9.0.5/32 -p tcp --dport 29503 -j RETURN",
        "-A PJ-x-IN -d 10.9.0.2/32 -j DROP",
        *world_a[2:],  # a2 has no port named monitor: that rule admits nothing
        "-A PJ-x-IN -d 10.9.0.3/32 -j DROP",
    ]

    dns = [{"ports": [{"protocol": "UDP", "port": 53}]}]
    egress = {
        "metadata": {"name": "e", "namespace": "ns"},
        "spec": {**job_a, "policyTypes": ["Egress"], "egress": dns},
    }
    assert rules([egress], [a1], "PJ-x")[3:] == [
        "-A PJ-x-OUT -s 10.9.0.2/32 -p udp --dport 53 -j RETURN",
        "-A PJ-x-OUT -s 10.9.0.2/32 -j DROP",
    ]
    unsupported = {
        "metadata": {"name": "u", "namespace": "ns"},
        "spec": {**job_a, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}]},
    }
    with pytest.raises(ValueError, match="ipBlock"):
        rules([unsupported], [a1], "PJ-x")
