"""The process-kubelet: a node that runs each Pod's container as a real local process.

It watches Pods through the API like a kubelet (acting as the scheduler too: it binds the
pods it can run), runs the container's command + args with its env in the pod network (see
network.py), and reports the Pod's status back through the API: phase Pending -> Running ->
Succeeded/Failed, podIP, startTime, conditions, containerStatuses with the exit code. It
honours restartPolicy (restarting in place, with restartCount), graceful deletion (SIGTERM,
then SIGKILL after the grace period, capped, then the final delete), and refuses pods that ask
for GPUs or node labels it has not, or, given a `capacity` (e.g. {"cpu": "5"}), more of a
resource than its pods leave free (they stay Pending, Unschedulable, as on a real node, and
are placed once they fit: a pod that ends gives its room back, and tests may change the
capacity as a node's would change).
As the default scheduler, it never binds a pod with schedulingGates (Kueue's admission gate),
nor one that names another scheduler (`schedulerName: volcano`): that scheduler binds it
(tests/harness/gang.py), and the node then runs it.
A container is its process group: when the main process ends, whatever it left running is
killed, as a real container's end kills everything in it.

Only one container per pod; images are ignored (`python` is the interpreter running the
tests); volumes, probes, init containers, security contexts and envFrom are not emulated.
Tests can crash a pod's process (`kill`) or evict the pod (`evict`)."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from harness.apiserver import now
from harness.client import Api, ApiError, path
from harness.network import PodNetwork
from harness.selectors import selects
from pipejob.core.contract import TERMINATION_LOG
from pipejob.operator.gang import quantity

PODS = "v1/pods"
# The "image": the interpreter of the tests first on PATH, so `python` runs pipejob.trainer.
PATH = f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CONDITIONS = ("PodScheduled", "Initialized", "ContainersReady", "Ready")
DEFAULT_SCHEDULER = "default-scheduler"


@dataclass
class PodRun:
    """One pod on this node, and its container's process."""

    pod: dict
    dir: Path
    address: str = ""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    started_at: str = ""  # the pod's start
    container_started_at: str = ""
    restarts: int = 0
    last_state: dict = field(default_factory=dict)
    restart_at: float | None = None  # restartPolicy: when to start the container again
    kill_at: float | None = None  # graceful deletion: when SIGTERM becomes SIGKILL
    evicted: str | None = None
    done: bool = False  # a terminal phase has been reported
    deleted: bool = False  # the pod is gone from the API (kept here for its logs)
    fqdn_published: bool = False

    @property
    def namespace(self) -> str:
        return self.pod["metadata"]["namespace"]

    @property
    def name(self) -> str:
        return self.pod["metadata"]["name"]

    @property
    def running(self) -> bool:
        """The main process has not exited (looked at without reaping it: see `reap`)."""
        if not self.unreaped:
            return False
        try:
            flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
            return os.waitid(os.P_PID, self.process.pid, flags) is None
        except ChildProcessError:  # reaped by another thread meanwhile
            return False

    @property
    def unreaped(self) -> bool:
        """Until reaped, the main process's pid, and so its group's id, cannot be reused."""
        return self.process is not None and self.process.returncode is None

    def reap(self) -> int | None:
        """The exit code once the main process has exited. The rest of its process group is
        killed first, as a container ends as a whole (and a `--pdeathsig` leader can die
        without the kubelet's kill reaching its children)."""
        if self.running:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait()

    @property
    def log(self) -> Path:
        return self.dir / "log"


class Kubelet:
    NODE = "process-kubelet"
    Run = PodRun  # what it keeps per pod

    def __init__(
        self,
        api: Api,
        workdir: Path,
        node: str = NODE,
        max_grace: float = 5.0,
        restart_backoff: float = 1.0,
        capacity: dict[str, str] | None = None,
    ):
        self.api = api
        self.capacity = dict(capacity or {})  # requests this node can hold, by resource
        self.workdir = Path(workdir)
        self.node = node
        self.max_grace = max_grace
        self.restart_backoff = restart_backoff
        self._runs: dict[str, PodRun] = {}  # by pod uid
        self._unschedulable: set[str] = set()  # pod uids reported as such
        self._waiting: dict[str, dict] = {}  # unschedulable pods, by uid: tried again
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._watch = None
        self._threads = [
            threading.Thread(target=self._watch_pods, name="kubelet-watch", daemon=True),
            threading.Thread(target=self._monitor, name="kubelet-monitor", daemon=True),
        ]
        self.network: PodNetwork | None = None

    # --- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Kubelet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.network = PodNetwork(self.workdir)
        atexit.register(self.stop)
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Kill every pod process (whole process groups) and stop watching; bounded."""
        self._stopping.set()
        if self._watch is not None:
            self._watch.close()
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            self._signal(run, signal.SIGKILL)
        for run in runs:
            if run.process is not None:
                try:
                    run.process.wait(5)
                except subprocess.TimeoutExpired:
                    self._say(f"pid {run.process.pid} of pod {run.name} did not die")
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(5)
        if self.network is not None:
            self.network.close()
        atexit.unregister(self.stop)

    # --- what tests use ---------------------------------------------------------------------

    def runs(self, namespace: str | None = None) -> list[PodRun]:
        """Every pod this node took, in order, deleted ones included."""
        with self._lock:
            return [r for r in self._runs.values() if namespace in (None, r.namespace)]

    def run(self, namespace: str, name: str) -> PodRun | None:
        """The latest pod of that name on this node."""
        found = [r for r in self.runs(namespace) if r.name == name]
        return found[-1] if found else None

    def running(self) -> list[PodRun]:
        return [r for r in self.runs() if r.running]

    def logs(self, namespace: str, name: str) -> str:
        run = self.run(namespace, name)
        return run.log.read_text(errors="replace") if run and run.log.exists() else ""

    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> int:
        """Crash the pod's process (as an OOM kill would); returns its pid."""
        run = self.run(namespace, name)
        if run is None or not run.running:
            raise LookupError(f"pod {namespace}/{name} has no running process on this node")
        self._signal(run, sig)
        return run.process.pid

    def evict(
        self, namespace: str, name: str, message: str = "The node was low on memory."
    ) -> None:
        """Evict the pod: kill its process and report the pod Failed with reason Evicted."""
        run = self.run(namespace, name)
        if run is None or run.done:
            raise LookupError(f"pod {namespace}/{name} is not active on this node")
        run.evicted = message
        self._signal(run, signal.SIGKILL)

    # --- watching pods ----------------------------------------------------------------------

    def _watch_pods(self) -> None:
        while not self._stopping.is_set():
            try:
                self._watch = self.api.watch(PODS)
                if self._stopping.is_set():  # stop() came while this watch was being made
                    self._watch.close()
                for event in self._watch:
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self._on_pod(event["type"], event["object"])
            except (ApiError, OSError) as e:
                self._say(f"watch failed ({e}); retrying")
            self._stopping.wait(0.2)

    def _on_pod(self, kind: str, pod: dict) -> None:
        meta, spec = pod["metadata"], pod.get("spec", {})
        with self._lock:
            run = self._runs.get(meta["uid"])
        if kind == "DELETED":
            self._waiting.pop(meta["uid"], None)
            if run is not None:
                run.deleted = True
                run.restart_at = None
                self._signal(run, signal.SIGKILL)
            return
        if spec.get("nodeName") not in (None, "", self.node):
            return
        if meta.get("deletionTimestamp"):
            if run is not None:
                run.restart_at = None  # no more restarts: the pod is going
            if run is None or not run.running:
                self._final_delete(pod)
            elif run.kill_at is None:
                grace = min(float(meta.get("deletionGracePeriodSeconds") or 0), self.max_grace)
                run.kill_at = time.monotonic() + grace
                self._signal(run, signal.SIGTERM)
            return
        if not spec.get("nodeName") and (
            spec.get("schedulingGates")
            or spec.get("schedulerName", DEFAULT_SCHEDULER) != DEFAULT_SCHEDULER
        ):
            return  # gated until admitted, or another scheduler's to place
        if run is None and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
            self._admit(pod)

    def _admit(self, pod: dict) -> None:
        meta = pod["metadata"]
        with self._lock:  # one placement at a time: each sees the room the last one took
            if meta["uid"] in self._runs:  # placed meanwhile (a watch event and a retry)
                return
            unfit = self._unfit(pod)
            if unfit:
                self._waiting[meta["uid"]] = pod
            else:
                self._waiting.pop(meta["uid"], None)
                self._runs[meta["uid"]] = self.Run(
                    pod=pod,
                    dir=self.workdir / meta["namespace"] / f"{meta['name']}-{meta['uid'][:8]}",
                )
        if unfit and meta["uid"] not in self._unschedulable:
            self._unschedulable.add(meta["uid"])
            self._patch_status(
                pod,
                {
                    "phase": "Pending",
                    "conditions": [
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "Unschedulable",
                            "message": f"0/1 nodes are available: {unfit}.",
                            "lastTransitionTime": now(),
                        }
                    ],
                },
            )
        if unfit:
            return
        run = self._runs[meta["uid"]]
        run.dir.mkdir(parents=True, exist_ok=True)
        try:
            if not pod.get("spec", {}).get("nodeName"):
                self.api.request(
                    "POST",
                    path(PODS, run.namespace, run.name, "binding"),
                    {
                        "apiVersion": "v1",
                        "kind": "Binding",
                        "metadata": {"name": run.name, "uid": meta["uid"]},
                        "target": {"apiVersion": "v1", "kind": "Node", "name": self.node},
                    },
                )
            run.address = self.network.address(run.namespace, run.name)
            run.argv, run.env = self._container(pod, run)
        except ApiError as e:  # deleted or bound elsewhere meanwhile
            self._say(f"could not take pod {run.namespace}/{run.name}: {e}")
            with self._lock:
                self._runs.pop(meta["uid"], None)
            return
        except ValueError as e:
            run.done = True
            self._patch_status(
                pod, {"phase": "Failed", "reason": "CreateContainerError", "message": str(e)}
            )
            return
        self._publish_dns(run)
        run.started_at = now()
        self._spawn(run)

    def _unfit(self, pod: dict) -> str | None:
        """Why this node cannot run the pod (as the scheduler would say), or None."""
        spec = pod.get("spec", {})
        for container in spec.get("containers", []):
            resources = container.get("resources") or {}
            for amounts in (resources.get("limits") or {}, resources.get("requests") or {}):
                if int(amounts.get("nvidia.com/gpu", 0) or 0) > 0:
                    return "1 Insufficient nvidia.com/gpu"
        labels = {"kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux"}
        if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
            return "1 node(s) didn't match Pod's node affinity/selector"
        held = [r.pod for r in self._runs.values() if not (r.done or r.deleted)]
        for resource, amount in self.capacity.items():
            used = sum(_requested(p, resource) for p in held)
            if used + _requested(pod, resource) > quantity(amount):
                return f"1 Insufficient {resource}"
        return None

    def _container(self, pod: dict, run: PodRun) -> tuple[list[str], dict[str, str]]:
        containers = pod.get("spec", {}).get("containers") or []
        if len(containers) != 1:
            raise ValueError(
                f"the process-kubelet runs exactly one container, got {len(containers)}"
            )
        container = containers[0]
        if not container.get("command"):
            raise ValueError(
                "the process-kubelet needs the container's command (images are not run)"
            )
        if container.get("envFrom"):
            raise ValueError("the process-kubelet does not emulate envFrom")
        env = {
            "PATH": PATH,
            "HOME": str(run.dir),
            "HOSTNAME": self._hostname(pod),
            # The container's terminationMessagePath, as a file of the pod's own.
            TERMINATION_LOG: str(run.dir / "termination-log"),
        }
        for var in container.get("env") or []:  # in order: later entries win, $(VAR) expands
            if "valueFrom" in var:
                env[var["name"]] = self._value_from(pod, run, var["valueFrom"])
            else:
                env[var["name"]] = _expand(var.get("value", ""), env)
        argv = [_expand(a, env) for a in container["command"] + (container.get("args") or [])]
        return argv, env

    def _value_from(self, pod: dict, run: PodRun, source: dict) -> str:
        fields = {
            "metadata.name": run.name,
            "metadata.namespace": run.namespace,
            "metadata.uid": pod["metadata"]["uid"],
            "spec.nodeName": self.node,
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
            "status.podIP": run.address,
            "status.hostIP": "127.0.0.1",
        }
        field_path = source.get("fieldRef", {}).get("fieldPath")
        if field_path in fields:
            return fields[field_path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", field_path or "")
        if m:
            return (pod["metadata"].get(m[1]) or {}).get(m[2], "")
        raise ValueError(f"the process-kubelet does not emulate valueFrom {source}")

    def _hostname(self, pod: dict) -> str:
        return pod["spec"].get("hostname") or pod["metadata"]["name"]

    def _publish_dns(self, run: PodRun) -> None:
        """The pod's own hostname; and once its headless Service selects it, its DNS names."""
        spec, ns = run.pod["spec"], run.namespace
        host, subdomain = self._hostname(run.pod), spec.get("subdomain")
        self.network.publish(run.address, [host])
        if subdomain and not run.fqdn_published:
            service = self.api.find("v1/services", subdomain, ns)
            if (
                service
                and service["spec"].get("clusterIP") == "None"
                and selects(service["spec"].get("selector"), run.pod)
            ):
                name = f"{host}.{subdomain}"
                self.network.publish(
                    run.address,
                    [
                        f"{name}.{ns}.svc.cluster.local",
                        f"{name}.{ns}.svc",
                        f"{name}.{ns}",
                        name,
                    ],
                )
                run.fqdn_published = True

    # --- processes --------------------------------------------------------------------------

    def _spawn(self, run: PodRun) -> None:
        run.container_started_at = now()
        with run.log.open("ab") as log:
            run.process = subprocess.Popen(
                self.network.command(run.argv, self._hostname(run.pod)),
                env=run.env,
                cwd=run.dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group
            )
        self._patch_status(
            run.pod,
            {
                "phase": "Running",
                "hostIP": "127.0.0.1",
                "podIP": run.address,
                "podIPs": [{"ip": run.address}],
                "startTime": run.started_at,
                "conditions": _conditions("True"),
                "containerStatuses": [
                    self._container_status(
                        run, {"running": {"startedAt": run.container_started_at}}
                    )
                ],
            },
        )

    def _signal(self, run: PodRun, sig: int) -> None:
        if run.unreaped:  # the group may outlive its leader
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.process.pid, sig)

    def _monitor(self) -> None:
        """Reap exits, escalate graceful kills, restart containers, publish late DNS names,
        place the pods that did not fit once they do."""
        last_dns = 0.0
        while not self._stopping.wait(0.1):
            for pod in list(self._waiting.values()):
                try:
                    self._admit(pod)
                except (ApiError, OSError) as e:
                    self._say(f"pod {pod['metadata']['name']}: {e}")
            for run in self.runs():
                if run.deleted:
                    continue
                try:
                    self._tend(run, dns=time.monotonic() - last_dns > 0.5)
                except (ApiError, OSError) as e:
                    self._say(f"pod {run.namespace}/{run.name}: {e}")
            last_dns = time.monotonic() if time.monotonic() - last_dns > 0.5 else last_dns

    def _tend(self, run: PodRun, dns: bool) -> None:
        if run.process is not None and not run.done and run.restart_at is None:
            code = run.reap()
            if code is not None:
                self._exited(run, 128 - code if code < 0 else code)
        if run.kill_at is not None and time.monotonic() > run.kill_at:
            self._signal(run, signal.SIGKILL)
        if run.restart_at is not None and time.monotonic() > run.restart_at:
            run.restart_at = None
            self._spawn(run)
        if dns and run.running and not run.fqdn_published:
            self._publish_dns(run)

    def _exited(self, run: PodRun, code: int) -> None:
        terminated = {
            "terminated": {
                "exitCode": code,
                "reason": self._exit_reason(run, code),
                "startedAt": run.container_started_at,
                "finishedAt": now(),
                "containerID": self._container_id(run),
            }
        }
        policy = run.pod["spec"].get("restartPolicy", "Always")
        restart = policy == "Always" or (policy == "OnFailure" and code != 0)
        if restart and run.kill_at is None and run.evicted is None:
            run.restarts += 1
            run.last_state = terminated
            run.restart_at = time.monotonic() + self.restart_backoff
            self._patch_status(
                run.pod,
                {
                    "containerStatuses": [
                        self._container_status(
                            run,
                            {"waiting": {"reason": "CrashLoopBackOff"}},
                            ready=False,
                        )
                    ]
                },
            )
            return
        run.done = True
        # As a kubelet does: the file's content whatever the exit; the log's tail instead
        # only for a failure that left it empty, under FallbackToLogsOnError.
        written = run.dir / "termination-log"
        message = written.read_text(errors="replace").strip() if written.exists() else ""
        if message:
            terminated["terminated"]["message"] = message[:4096]
        elif code != 0 and run.pod["spec"]["containers"][0].get("terminationMessagePolicy") == (
            "FallbackToLogsOnError"
        ):
            terminated["terminated"]["message"] = _log_tail(run.log)
        status = {
            "phase": "Succeeded" if code == 0 and run.evicted is None else "Failed",
            "conditions": _conditions("False"),
            "containerStatuses": [self._container_status(run, terminated, ready=False)],
        }
        if run.evicted is not None:  # as kubelets since Kubernetes 1.26 report an eviction
            status |= {"reason": "Evicted", "message": run.evicted}
            status["conditions"].append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "TerminationByKubelet",
                    "message": run.evicted,
                    "lastTransitionTime": now(),
                }
            )
        self._patch_status(run.pod, status)
        if run.kill_at is not None:
            self._final_delete(run.pod)

    def _container_status(self, run: PodRun, state: dict, ready: bool = True) -> dict:
        container = run.pod["spec"]["containers"][0]
        return {
            "name": container["name"],
            "image": container.get("image", ""),
            "imageID": "",
            "containerID": self._container_id(run),
            "ready": ready,
            "started": ready,
            "restartCount": run.restarts,
            "state": state,
            "lastState": run.last_state,
        }

    def _container_id(self, run: PodRun) -> str:
        return f"process://{run.process.pid}" if run.process else ""

    def _exit_reason(self, run: PodRun, code: int) -> str:
        return "Completed" if code == 0 else "Error"

    # --- API writes -------------------------------------------------------------------------

    # Writes name the pod by its uid too, as a kubelet's do: a pod deleted meanwhile may have
    # been created again under its name (a restarted world), and is another pod.

    def _patch_status(self, pod: dict, status: dict) -> None:
        body = {"metadata": {"uid": pod["metadata"]["uid"]}, "status": status}
        try:
            self.api.patch(
                PODS,
                pod["metadata"]["name"],
                body,
                pod["metadata"]["namespace"],
                subresource="status",
            )
        except ApiError as e:
            if e.status not in (404, 409):  # a pod deleted meanwhile has no status to report
                raise

    def _final_delete(self, pod: dict) -> None:
        """The kubelet's part of a graceful deletion: the containers are gone, remove the pod."""
        options = {"gracePeriodSeconds": 0, "preconditions": {"uid": pod["metadata"]["uid"]}}
        try:
            self.api.delete(PODS, pod["metadata"]["name"], pod["metadata"]["namespace"], options)
        except ApiError as e:
            if e.status not in (404, 409):
                raise

    def _say(self, message: str) -> None:
        print(f"[process-kubelet] {message}", file=sys.stderr, flush=True)


def _requested(pod: dict, resource: str) -> Decimal:
    """What the pod's containers request of `resource` (a limit alone counts as its request)."""
    total = Decimal(0)
    for container in pod.get("spec", {}).get("containers") or []:
        resources = container.get("resources") or {}
        wanted = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        total += quantity(wanted.get(resource, 0))
    return total


def _log_tail(log: Path) -> str:
    """What a kubelet makes the termination message of a failed container: its log's end."""
    lines = log.read_bytes()[-2048:].decode("utf-8", "replace").splitlines()
    return "\n".join(lines[-80:])


def _conditions(status: str) -> list[dict]:
    return [
        {
            "type": t,
            "status": "True" if t in CONDITIONS[:2] else status,
            "lastTransitionTime": now(),
        }
        for t in CONDITIONS
    ]


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) references in env values, command and args; $$ escapes."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]),
        text,
    )
