"""The container-kubelet: a node that runs each Pod as a docker container of the pod's image.

It is the process-kubelet (kubelet.py: the watch, binding, scheduling refusals, env with
fieldRefs and $(VAR), restartPolicy, graceful deletion, phases, conditions and container
statuses, termination messages) with docker as its container runtime, on a bridge network of
the test's own (docker.Network) and nothing else:

- the pod's image, command (the image's ENTRYPOINT otherwise) and args (its CMD otherwise);
- the pod's address on that network (fixed before the start, so `status.podIP` is known to
  the env), its hostname, and the DNS names of its headless Service as network aliases
  (`hostname.subdomain[.namespace[.svc[.cluster.local]]]` and the Service's own names, which
  resolve to every pod it selects), when the Service exists as the pod starts;
- the security context of the pod and the container: runAsUser, runAsGroup, runAsNonRoot
  (refusing uid 0, or a non-numeric image user, as a kubelet does), capabilities,
  allowPrivilegeEscalation: false (no-new-privileges), readOnlyRootFilesystem;
- `resources.limits` cpu and memory as docker's limits; an OOM kill is reported `OOMKilled`;
- terminationMessagePath as a file of the node's, read back into the container status;
- volumes: emptyDir (a directory per pod), persistentVolumeClaim (one docker volume per claim,
  shared by every pod that mounts it, kept until the node ends), configMap (its keys as
  read-only files);
- with `in_cluster` (incluster.py), the API server as pods reach it: KUBERNETES_SERVICE_HOST
  and _PORT in every container, and the service account's token, CA and namespace mounted
  unless the pod sets automountServiceAccountToken: false;
- an image that is not on the node stays Pending, ErrImagePull (no registry is reachable);
- deletion stops and removes the container;
- the cluster's NetworkPolicies, enforced on the bridge with iptables as a network plugin
  would (netpolicy.py), in force before a pod's container starts.

Not emulated (refused where a pod asks for them): other volume types, envFrom, init and
side-car containers, probes (the pod is Ready once it runs)."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.apiserver import now
from harness.client import Api
from harness.docker import LABEL, Network, cli, inspect
from harness.incluster import MOUNT, InClusterAccess
from harness.kubelet import Kubelet, PodRun, _conditions, _expand
from harness.netpolicy import Endpoint, NetworkPlugin

MEMORY = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


@dataclass
class ContainerRun(PodRun):
    """One pod on this node, and its container (one per start: restarts make new ones)."""

    container: str = ""
    exit_code: int | None = None  # set once the container has exited and its log is saved
    oom_killed: bool = False
    waiter: threading.Thread | None = None
    volumes: list[str] = field(default_factory=list)  # docker run arguments

    @property
    def running(self) -> bool:
        return bool(self.container) and self.exit_code is None

    @property
    def unreaped(self) -> bool:
        return self.running

    def reap(self) -> int | None:
        return self.exit_code


class ContainerKubelet(Kubelet):
    NODE = "container-kubelet"
    Run = ContainerRun

    def __init__(
        self,
        api: Api,
        workdir: Path,
        network: Network,
        in_cluster: InClusterAccess | None = None,
        **kwargs,
    ) -> None:
        super().__init__(api, workdir, **kwargs)
        self.network = network
        self.in_cluster = in_cluster  # the API server as pods reach it
        self._claims: dict[tuple[str, str], str] = {}  # (namespace, claim) -> docker volume
        self.plugin = NetworkPlugin(api, network, self._endpoints)

    def __enter__(self) -> ContainerKubelet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.plugin.start()
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Remove every container and claim volume, the network plugin's rules, stop watching;
        the network is the test's."""
        self._stopping.set()
        if self._watch is not None:
            self._watch.close()
        for run in self.runs():
            self._remove(run)
        self.plugin.close()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(5)
        if self._claims:
            cli("volume", "rm", "-f", *self._claims.values(), check=False)

    # --- what tests use ---------------------------------------------------------------------

    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> str:
        """`docker kill` the pod's container; returns the container's name."""
        run = self.run(namespace, name)
        if run is None or not run.running:
            raise LookupError(f"pod {namespace}/{name} has no running container on this node")
        self._signal(run, sig)
        return run.container

    def logs(self, namespace: str, name: str) -> str:
        """The pod's log: of its earlier containers (saved as each ended), then `docker logs`
        of the running one."""
        run = self.run(namespace, name)
        if run is None:
            return ""
        saved = run.log.read_text(errors="replace") if run.log.exists() else ""
        if run.running:
            live = subprocess.run(
                ["docker", "logs", run.container],
                capture_output=True,
                text=True,
                errors="replace",
                timeout=30,
            )
            saved += live.stdout + live.stderr
        return saved

    def containers(self) -> list[str]:
        """The names of every container of this node that docker still has."""
        out = cli("ps", "-a", "--format", "{{.Names}}", "--filter", f"name={self.network.name}-")
        return out.split()

    # --- the pod as a container -------------------------------------------------------------

    def _on_pod(self, kind: str, pod: dict) -> None:
        super()._on_pod(kind, pod)
        run = self._runs.get(pod["metadata"]["uid"])
        if kind == "DELETED" and run is not None:
            self._remove(run)

    def _container(self, pod: dict, run: ContainerRun) -> tuple[list[str], dict[str, str]]:
        containers = pod["spec"].get("containers") or []
        if len(containers) != 1 or pod["spec"].get("initContainers"):
            raise ValueError("the container-kubelet runs exactly one container per pod")
        container = containers[0]
        if container.get("envFrom"):
            raise ValueError("the container-kubelet does not emulate envFrom")
        env = self.in_cluster.env() if self.in_cluster else {}
        for var in container.get("env") or []:
            if "valueFrom" in var:
                env[var["name"]] = self._value_from(pod, run, var["valueFrom"])
            else:
                env[var["name"]] = _expand(var.get("value", ""), env)
        run.volumes = self._volumes(pod, run, container)
        command = [_expand(a, env) for a in container.get("command") or []]
        args = [_expand(a, env) for a in container.get("args") or []]
        return command + args, env

    def _value_from(self, pod: dict, run: PodRun, source: dict) -> str:
        if source.get("fieldRef", {}).get("fieldPath") == "status.hostIP":
            return self.network.gateway
        return super()._value_from(pod, run, source)

    def _user(self, pod: dict, image: dict) -> list[str]:
        """`--user` from the security contexts; refuses root under runAsNonRoot."""
        pod_sc = pod["spec"].get("securityContext") or {}
        sc = pod_sc | (pod["spec"]["containers"][0].get("securityContext") or {})
        uid, gid = sc.get("runAsUser"), sc.get("runAsGroup")
        image_user = (image["Config"].get("User") or "0").split(":")[0]
        if sc.get("runAsNonRoot"):
            effective = str(uid) if uid is not None else image_user
            if not effective.isdigit():
                raise ValueError(
                    f"container has runAsNonRoot and image has non-numeric user "
                    f"({effective}), cannot verify user is non-root"
                )
            if effective == "0":
                raise ValueError("container has runAsNonRoot and image will run as root")
        if uid is None and gid is None:
            return []
        return ["--user", f"{uid if uid is not None else image_user}:{gid or 0}"]

    def _security(self, container: dict) -> list[str]:
        sc = container.get("securityContext") or {}
        if sc.get("privileged"):
            raise ValueError("the container-kubelet runs no privileged container")
        caps = sc.get("capabilities") or {}
        argv = [f"--cap-drop={c}" for c in caps.get("drop") or []]
        argv += [f"--cap-add={c}" for c in caps.get("add") or []]
        if sc.get("allowPrivilegeEscalation") is False:
            argv += ["--security-opt", "no-new-privileges"]
        if sc.get("readOnlyRootFilesystem"):
            argv += ["--read-only"]
        limits = (container.get("resources") or {}).get("limits") or {}
        if "cpu" in limits:
            cpu = str(limits["cpu"])
            argv += ["--cpus", str(int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu))]
        if "memory" in limits:
            m = re.fullmatch(r"(\d+)([KMG]i?|k|)", str(limits["memory"]))
            if m is None:
                raise ValueError(f"resources.limits.memory {limits['memory']!r} is not a quantity")
            argv += ["--memory", str(int(m[1]) * MEMORY[m[2]]), "--memory-swap", "-1"]
        return argv

    def _volumes(self, pod: dict, run: ContainerRun, container: dict) -> list[str]:
        sources = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        argv = []
        if self.in_cluster and pod["spec"].get("automountServiceAccountToken") is not False:
            account = pod["spec"].get("serviceAccountName") or "default"
            argv += ["-v", f"{self.in_cluster.account(run.namespace, account)}:{MOUNT}:ro"]
        for mount in container.get("volumeMounts") or []:
            volume = sources.get(mount["name"])
            if volume is None:
                raise ValueError(f"volumeMount {mount['name']!r} names no volume of the pod")
            source = self._volume_source(pod, run, volume)
            if mount.get("subPath"):
                source = f"{source}/{mount['subPath']}"
            read_only = mount.get("readOnly") or "configMap" in volume
            argv += ["-v", f"{source}:{mount['mountPath']}{':ro' if read_only else ''}"]
        return argv

    def _volume_source(self, pod: dict, run: ContainerRun, volume: dict) -> str:
        ns, name = run.namespace, volume["name"]
        if "emptyDir" in volume:  # world-writable, as a kubelet makes an emptyDir
            return str(_shared_dir(run.dir / "volumes" / name))
        if "configMap" in volume:
            config = self.api.get("v1/configmaps", volume["configMap"]["name"], ns)
            folder = _shared_dir(run.dir / "configmaps" / name)
            for key, value in (config.get("data") or {}).items():
                (folder / key).write_text(value)
            return str(folder)
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            self.api.get("v1/persistentvolumeclaims", claim, ns)  # it must exist
            if (ns, claim) not in self._claims:  # a docker volume backed by a node directory
                folder = _shared_dir(self.workdir / "claims" / ns / claim)
                volume_name = f"{self.network.name}-{ns}-{claim}"
                cli(
                    "volume",
                    "create",
                    "--label",
                    f"{LABEL}={self.node}",
                    "--opt",
                    "type=none",
                    "--opt",
                    "o=bind",
                    "--opt",
                    f"device={folder}",
                    volume_name,
                )
                self._claims[ns, claim] = volume_name
            return self._claims[ns, claim]
        raise ValueError(f"the container-kubelet does not emulate volume {name!r}: {volume}")

    def claim_dir(self, namespace: str, claim: str) -> Path:
        """The node directory behind a PersistentVolumeClaim's docker volume."""
        return self.workdir / "claims" / namespace / claim

    def _aliases(self, run: ContainerRun) -> list[str]:
        spec, ns = run.pod["spec"], run.namespace
        host, subdomain = self._hostname(run.pod), spec.get("subdomain")
        service = self.api.find("v1/services", subdomain, ns) if subdomain else None
        if not service or service["spec"].get("clusterIP") != "None":
            return [host]
        suffixes = ("", f".{ns}", f".{ns}.svc", f".{ns}.svc.cluster.local")
        return [host] + [f"{n}{s}" for n in (f"{host}.{subdomain}", subdomain) for s in suffixes]

    def _publish_dns(self, run: PodRun) -> None:
        """Docker's DNS serves the names: they are the container's network aliases."""

    def _endpoints(self) -> list[Endpoint]:
        """The pods on the bridge, for the network plugin: every one given an address."""
        return [
            Endpoint(
                r.namespace,
                r.pod["metadata"].get("labels") or {},
                r.address,
                {
                    p["name"]: p["containerPort"]
                    for c in r.pod["spec"]["containers"]
                    for p in c.get("ports") or []
                    if p.get("name")
                },
            )
            for r in self.runs()
            if r.address and not r.deleted
        ]

    # --- the container runtime --------------------------------------------------------------

    def _spawn(self, run: ContainerRun) -> None:
        container = run.pod["spec"]["containers"][0]
        image = inspect(container["image"], "image")
        if image is None:
            self._patch_status(
                run.pod,
                {
                    "phase": "Pending",
                    "containerStatuses": [
                        self._container_status(
                            run,
                            {
                                "waiting": {
                                    "reason": "ErrImagePull",
                                    "message": f"image {container['image']!r} is not on the node"
                                    " and no registry is reachable",
                                }
                            },
                            ready=False,
                        ),
                    ],
                },
            )
            return
        try:
            user = self._user(run.pod, image) + self._security(container)
        except ValueError as e:
            self._patch_status(
                run.pod,
                {
                    "phase": "Pending",
                    "containerStatuses": [
                        self._container_status(
                            run,
                            {
                                "waiting": {
                                    "reason": "CreateContainerConfigError",
                                    "message": str(e),
                                }
                            },
                            ready=False,
                        ),
                    ],
                },
            )
            return
        path = container.get("terminationMessagePath") or "/dev/termination-log"
        message = run.dir / "termination-log"
        message.write_text("")
        message.chmod(0o666)  # whatever user the container runs as writes it
        name = f"{self.network.name}-{run.name}-{run.pod['metadata']['uid'][:8]}-{run.restarts}"
        argv = [
            "run",
            "-d",
            "--name",
            name,
            "--label",
            f"{LABEL}={self.node}",
            "--network",
            self.network.name,
            "--ip",
            run.address,
            "--hostname",
            self._hostname(run.pod),
            *[f"--network-alias={a}" for a in self._aliases(run)],
            *user,
            *run.volumes,
            "-v",
            f"{message}:{path}",
            *[f"--env={k}={v}" for k, v in run.env.items()],
        ]
        if container.get("command"):
            argv += ["--entrypoint", run.argv[0], container["image"], *run.argv[1:]]
        else:
            argv += [container["image"], *run.argv]
        run.container_started_at = now()
        run.exit_code, run.oom_killed = None, False
        try:
            self.plugin.sync()  # the pod's isolation holds before its container starts
            cli(*argv)
        except (RuntimeError, ValueError) as e:
            # docker or the network plugin refused it: as a kubelet's RunContainerError
            run.done = True
            self._patch_status(
                run.pod, {"phase": "Failed", "reason": "RunContainerError", "message": str(e)}
            )
            return
        run.container = name
        run.waiter = threading.Thread(target=self._wait, args=(run, name), daemon=True)
        run.waiter.start()
        self._patch_status(
            run.pod,
            {
                "phase": "Running",
                "hostIP": self.network.gateway,
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

    def _wait(self, run: ContainerRun, name: str) -> None:
        """`docker wait` for the container's end; then its log and OOM flag, then its code."""
        done = subprocess.run(["docker", "wait", name], capture_output=True, text=True)
        code = int(done.stdout.strip() or 137)
        with run.log.open("ab") as log:
            subprocess.run(["docker", "logs", name], stdout=log, stderr=subprocess.STDOUT)
        run.oom_killed = _oom_killed(name, code)
        run.exit_code = code

    def _signal(self, run: ContainerRun, sig: int) -> None:
        if run.running:
            cli("kill", f"--signal={signal.Signals(sig).name}", run.container, check=False)

    def _tend(self, run: ContainerRun, dns: bool) -> None:
        if run.container and not run.done and run.restart_at is None:
            code = run.reap()
            if code is not None:
                self._exited(run, code)
        if run.kill_at is not None and time.monotonic() > run.kill_at:
            self._signal(run, signal.SIGKILL)
        if run.restart_at is not None and time.monotonic() > run.restart_at:
            run.restart_at = None
            self._spawn(run)

    def _remove(self, run: ContainerRun) -> None:
        """Stop and remove every container the pod had (its logs are kept on the node)."""
        if run.running:
            cli("kill", run.container, check=False)
        if run.waiter is not None:
            run.waiter.join(30)
        names = cli(
            "ps",
            "-aq",
            "--filter",
            f"name={self.network.name}-{run.name}-{run.pod['metadata']['uid'][:8]}-",
            check=False,
        ).split()
        if names:
            cli("rm", "-f", *names, check=False)

    def _container_id(self, run: PodRun) -> str:
        return f"docker://{run.container}" if getattr(run, "container", "") else ""

    def _exit_reason(self, run: ContainerRun, code: int) -> str:
        return "OOMKilled" if run.oom_killed else super()._exit_reason(run, code)

    def _say(self, message: str) -> None:
        print(f"[container-kubelet] {message}", flush=True)


def _shared_dir(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o777)
    return folder


def _oom_killed(name: str, code: int) -> bool:
    """Whether docker says the OOM killer ended the container. On cgroup v2 its OOM event
    can land after the exit's, under load (a CI run saw 137 with the flag still unset), so
    the SIGKILLed end of a container with a memory limit is asked again for up to 2 s."""
    seen = inspect(name) or {}
    limited = ((seen.get("HostConfig") or {}).get("Memory") or 0) > 0
    deadline = time.monotonic() + (2.0 if code == 137 and limited else 0.0)
    while not (seen.get("State") or {}).get("OOMKilled"):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
        seen = inspect(name) or {}
    return True
