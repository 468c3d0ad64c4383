"""The container-kubelet's network plugin: the cluster's NetworkPolicies enforced on its docker
bridge with iptables, as a policy-enforcing plugin (Calico, Cilium) enforces them on a node.

As the API defines it: a pod that a policy with Ingress (Egress) in its policyTypes selects
is isolated for ingress (egress) and admits only what a rule of one of those policies allows
(their union; there is no deny); a pod no policy selects is open; replies to an allowed
connection pass; traffic from and to the node itself (the host, the bridge's gateway) is
always allowed. Here, traffic between containers on the bridge passes the host's FORWARD
chain (br_netfilter), where docker's DOCKER-USER chain comes first: it jumps to this
network's own chains, which return what is allowed and drop the rest of an isolated pod's.

Only what pipejob's policies use is emulated: peers by podSelector and namespaceSelector
(matchLabels, matchExpressions; a namespace has the one label kubernetes.io/metadata.name,
as the API server gives every namespace), ports by number or, in ingress rules, by the pod's
container port name (the chart's policy of the operator), and protocol. An ipBlock, an
endPort or a named port of an egress rule raises (the sync fails loudly), never passes
silently."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from harness.client import Api, ApiError
from harness.docker import Network, inspect
from harness.selectors import matches

POLICIES = "networking.k8s.io/v1/networkpolicies"
NAMESPACE_LABEL = "kubernetes.io/metadata.name"
BRIDGED = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")


@dataclass(frozen=True)
class Endpoint:
    """A pod on the bridge: where it is and what selects it."""

    namespace: str
    labels: Mapping[str, str]
    address: str
    ports: Mapping[str, int] = field(default_factory=dict)  # its containers' named ports


# Per direction: the policy type, its rules' key, their peers' key, the pod's side of a
# packet, the peer's side, and the chain's suffix.
DIRECTIONS = (
    ("Ingress", "ingress", "from", "-d", "-s", "IN"),
    ("Egress", "egress", "to", "-s", "-d", "OUT"),
)


def rules(policies: list[dict], pods: list[Endpoint], chain: str) -> list[str]:
    """The iptables rules (iptables-restore lines) of `chain` and its -IN and -OUT chains
    that enforce `policies` on `pods`."""
    lines = [
        f"-A {chain} -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN",
        f"-A {chain} -j {chain}-IN",
        f"-A {chain} -j {chain}-OUT",
    ]
    for kind, key, peers_key, own, other, part in DIRECTIONS:
        for pod in pods:
            selecting = [p for p in policies if _isolates(p, kind, pod)]
            allowed = [
                f"{peer}{port}"
                for policy in selecting
                for rule in policy["spec"].get(key) or []
                for peer in _peers(rule.get(peers_key), policy, pods, other)
                for port in _ports(rule, pod, kind)
            ]
            lines += [f"-A {chain}-{part} {own} {pod.address}/32{m} -j RETURN" for m in allowed]
            if selecting:
                lines.append(f"-A {chain}-{part} {own} {pod.address}/32 -j DROP")
    return lines


def _peers(peers: list[dict] | None, policy: dict, pods: list[Endpoint], side: str) -> list[str]:
    """The addresses a rule's peers select, as iptables matches; no peers: anyone."""
    if not peers:
        return [""]
    return [
        f" {side} {p.address}/32"
        for p in pods
        if any(_peer_selects(peer, policy, p) for peer in peers)
    ]


def _isolates(policy: dict, direction: str, pod: Endpoint) -> bool:
    spec, meta = policy["spec"], policy["metadata"]
    types = spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]
    return (
        direction in types
        and meta["namespace"] == pod.namespace
        and matches(spec.get("podSelector") or {}, pod.labels)
    )


def _peer_selects(peer: dict, policy: dict, pod: Endpoint) -> bool:
    if "ipBlock" in peer:
        raise ValueError(f"the container-kubelet's network plugin does not emulate ipBlock: {peer}")
    if "namespaceSelector" in peer:
        in_namespace = matches(peer["namespaceSelector"], {NAMESPACE_LABEL: pod.namespace})
    else:
        in_namespace = pod.namespace == policy["metadata"]["namespace"]
    return in_namespace and matches(peer.get("podSelector") or {}, pod.labels)


def _ports(rule: dict, pod: Endpoint, kind: str) -> list[str]:
    """A rule's ports as iptables matches; none given: every port."""
    if not rule.get("ports"):
        return [""]
    return [m for p in rule["ports"] if (m := _port(p, pod, kind)) is not None]


def _port(port: dict, pod: Endpoint, kind: str) -> str | None:
    """A rule's port as an iptables match; a port named in an ingress rule is the pod's own
    container port of that name (None when it has none: the rule admits nothing there)."""
    number = port.get("port")
    if isinstance(number, str) and kind == "Ingress":
        number = pod.ports.get(number)
        if number is None:
            return None
    if isinstance(number, str) or "endPort" in port:
        raise ValueError(f"the container-kubelet's network plugin does not emulate {port}")
    protocol = port.get("protocol", "TCP").lower()
    return f" -p {protocol}" + (f" --dport {number}" if number is not None else "")


class NetworkPlugin:
    """Keeps the iptables chains of `network` in step with the cluster's NetworkPolicies (a
    watch) and with the pods that `pods` lists (the kubelet calls `sync` before it starts a
    container, so no pod runs before its isolation holds)."""

    def __init__(self, api: Api, network: Network, pods: Callable[[], list[Endpoint]]):
        self.api = api
        self.pods = pods
        self.chain = "PJ-" + network.name.rsplit("-", 1)[-1]
        self.bridge = "br-" + inspect(network.name, "network")["Id"][:12]
        self._jump = ["DOCKER-USER", "-i", self.bridge, "-o", self.bridge, "-j", self.chain]
        self._applied: list[str] | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watch = None
        self._thread = threading.Thread(
            target=self._watch_policies, daemon=True, name="network-plugin"
        )

    def start(self) -> NetworkPlugin:
        if not BRIDGED.exists() or BRIDGED.read_text().strip() != "1":
            raise RuntimeError(
                f"{BRIDGED} is not 1 (`modprobe br_netfilter`, then `sysctl "
                "net.bridge.bridge-nf-call-iptables=1`): bridged traffic would "
                "bypass iptables, and no NetworkPolicy would hold"
            )
        _sweep()
        self.sync()
        _iptables("-I", *self._jump[:1], "1", *self._jump[1:])
        self._thread.start()
        return self

    def sync(self) -> None:
        """Rewrite the chains, at once (iptables-restore), if policies or pods changed."""
        with self._lock:
            policies = self.api.list(POLICIES)
            lines = rules(policies, self.pods(), self.chain)
            if lines == self._applied:
                return
            chains = [
                f":{c} - [0:0]" for c in (self.chain, f"{self.chain}-IN", f"{self.chain}-OUT")
            ]
            text = "\n".join(["*filter", *chains, *lines, "COMMIT", ""])
            done = subprocess.run(
                ["iptables-restore", "-w", "--noflush"],
                input=text,
                text=True,
                capture_output=True,
                timeout=30,
            )
            if done.returncode != 0:
                raise RuntimeError(f"iptables-restore failed: {done.stderr.strip()}")
            self._applied = lines

    def close(self) -> None:
        self._stopping.set()
        if self._watch is not None:
            self._watch.close()
        if self._thread.is_alive():
            self._thread.join(5)
        _remove(self._jump, self.chain)

    def _watch_policies(self) -> None:
        while not self._stopping.is_set():
            try:
                self._watch = self.api.watch(POLICIES)
                if self._stopping.is_set():
                    self._watch.close()
                for _ in self._watch:
                    self.sync()
            except (ApiError, OSError, ValueError, RuntimeError) as e:
                print(f"[network-plugin] {e}; retrying", file=sys.stderr, flush=True)
            self._stopping.wait(0.2)


def _iptables(*args: str, check: bool = True) -> None:
    subprocess.run(["iptables", "-w", *args], check=check, capture_output=True, timeout=30)


def _remove(jump: list[str], chain: str) -> None:
    _iptables("-D", *jump, check=False)
    for command in ("-F", "-X"):  # every chain emptied before any is deleted
        for name in (chain, f"{chain}-IN", f"{chain}-OUT"):
            _iptables(command, name, check=False)


def _sweep() -> None:
    """Remove what earlier runs left whose bridge is gone (a test killed before its end)."""
    listing = subprocess.run(
        ["iptables", "-w", "-S", "DOCKER-USER"], capture_output=True, text=True, timeout=30
    ).stdout
    for line in listing.splitlines():
        m = re.fullmatch(r"-A (DOCKER-USER -i (\S+) -o \S+ -j (PJ-\w+))", line)
        if m and not Path("/sys/class/net", m[2]).exists():
            _remove(m[1].split(), m[3])
