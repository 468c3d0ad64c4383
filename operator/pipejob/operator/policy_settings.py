"""What the operator's settings say about the NetworkPolicy of each job's world: whether there
is one, who besides the world may read its master's monitor port, and whether the world's
egress is restricted. The chart's values (networkPolicy.jobs) become one JSON value of
PIPEJOB_NETWORK_POLICY; the operator and `pipejob render` read it, and refuse a bad one
before anything starts, naming the field."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypedDict

from pipejob.core import k8s
from pipejob.core.errors import SpecError
from pipejob.core.k8s import KubeObject

POLICY_ENV = "PIPEJOB_NETWORK_POLICY"
OFF = "off"  # for clusters whose network plugin does not enforce NetworkPolicies


@dataclass(frozen=True)
class NetworkPolicySettings:
    # NetworkPolicyPeers admitted to the master's monitor port besides the world (the
    # operator's pods, which poll /progress, and Prometheus).
    monitor_from: tuple[KubeObject, ...] = ()
    # None: the world's egress is unrestricted. A tuple: NetworkPolicyEgressRules the world
    # may use besides reaching its own pods and DNS.
    egress: tuple[KubeObject, ...] | None = None


DEFAULT = NetworkPolicySettings()


class PolicySettingsJson(TypedDict, total=False):
    """PIPEJOB_NETWORK_POLICY's JSON object, as read (each list still to be checked)."""

    monitorFrom: list[KubeObject]  # NetworkPolicyPeers
    egress: list[KubeObject]  # NetworkPolicyEgressRules


class BadSettings(ValueError):
    pass


def parse(text: str | None) -> NetworkPolicySettings | None:
    """The settings from PIPEJOB_NETWORK_POLICY's value: unset or empty, the defaults (a policy,
    the monitor port for the world only, egress open); "off", no policy; else a JSON object
    {"monitorFrom": [NetworkPolicyPeer...], "egress": [NetworkPolicyEgressRule...]}, where
    "egress" present, even empty, restricts the world's egress."""
    if not (text or "").strip():
        return DEFAULT
    if text.strip() == OFF:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadSettings(f"{POLICY_ENV}: not JSON ({e.msg}), nor {OFF!r}") from None
    if not isinstance(value, dict):
        raise BadSettings(f"{POLICY_ENV}: must be a JSON object or {OFF!r}, got {text!r}")
    errors: list[SpecError] = []
    for key in value.keys() - {"monitorFrom", "egress"}:
        errors.append(SpecError(key, "unknown field (known: monitorFrom, egress)"))
    peers = _items(value, "monitorFrom", "NetworkPolicyPeer", errors)
    rules = None
    if "egress" in value:
        rules = _items(value, "egress", "NetworkPolicyEgressRule", errors)
    if errors:
        raise BadSettings(f"{POLICY_ENV}: " + "; ".join(map(str, errors)))
    return NetworkPolicySettings(peers or (), rules)


def _items(
    value: PolicySettingsJson, key: str, kind: str, errors: list[SpecError]
) -> tuple[KubeObject, ...]:
    """`value[key]`, a list of Kubernetes objects of type `kind`, checked against its schema."""
    items = value.get(key)
    if items is None:
        return ()
    if not isinstance(items, list):
        errors.append(SpecError(key, f"must be a list of {kind}s, got {items!r}"))
        return ()
    for i, item in enumerate(items):
        k8s.check(k8s.schema(kind), item, f"{key}[{i}]", errors)
        if item == {}:  # in a policy, an empty peer or rule admits everything
            errors.append(SpecError(f"{key}[{i}]", "must not be empty: that admits everyone"))
    return tuple(items)


def from_env(environ: Mapping[str, str] = os.environ) -> NetworkPolicySettings | None:
    return parse(environ.get(POLICY_ENV))


def describe(settings: NetworkPolicySettings | None) -> str:
    """One line for the operator's log."""
    if settings is None:
        return f"no NetworkPolicy per job ({POLICY_ENV}={OFF}): the worlds are open"
    egress = "open" if settings.egress is None else f"{len(settings.egress)} egress rule(s)"
    return (
        f"a NetworkPolicy per job: monitor port also from {len(settings.monitor_from)}"
        f" peer(s); egress {egress}"
    )
