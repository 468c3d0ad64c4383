"""The NetworkPolicy of a job's world (kube.network_policy), the settings that shape it
(policy_settings, PIPEJOB_NETWORK_POLICY as the chart writes it), and how the operator's
decision and `pipejob render` carry it. The emulated cluster shows it selecting exactly the
world's pods (test_operator_integration.py); the container tests show it enforced
(test_containers_e2e.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
import yaml

from pipejob.cli import main as cli
from pipejob.core.spec import API_VERSION, parse
from pipejob.operator import api_refusals, kube, reconcile
from pipejob.operator import policy_settings as ps

pytestmark = pytest.mark.timeout(30)

NOW = datetime(2025, 1, 2, tzinfo=UTC)
PROMETHEUS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}
STORE = {"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}], "ports": [{"port": 443}]}
WORLD = {"podSelector": {"matchLabels": {kube.JOB_LABEL: "j"}}}


def job_obj(kind: str = "HybridJob", **spec) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "metadata": {"name": "j", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": spec,
    }


def monitor_port(job) -> int:
    """The master pod's monitor port, as the world plan gives it to the pods."""
    master = kube.world(job, 0, "ns")[0]
    return next(
        p["containerPort"]
        for p in master["spec"]["containers"][0]["ports"]
        if p["name"] == "monitor"
    )


def test_the_default_policy_admits_the_world_only_and_leaves_egress_open() -> None:
    job = parse(job_obj(trainers=2))
    owner = kube.owner_reference(job_obj())
    policy = kube.network_policy(job, "ns", owner, ps.DEFAULT)
    assert policy["metadata"] == {
        "name": "j",
        "namespace": "ns",
        "ownerReferences": [owner],
        "labels": {kube.JOB_LABEL: "j", "app.kubernetes.io/managed-by": "pipejob"},
    }
    # Every pod of the job, of any world and any size: the job's label, not the restart's.
    assert policy["spec"] == {
        "podSelector": WORLD["podSelector"],
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [WORLD]}],
    }


def test_the_monitor_port_admits_the_named_peers_and_egress_can_be_restricted() -> None:
    job = parse(job_obj("PipelineJob", stages=2, replicas=2, batchSize=8, microBatches=2))
    settings = ps.NetworkPolicySettings(monitor_from=(PROMETHEUS,), egress=(STORE,))
    spec = kube.network_policy(job, "ns", None, settings)["spec"]
    assert spec["ingress"] == [
        {"from": [WORLD]},
        {"from": [PROMETHEUS], "ports": [{"protocol": "TCP", "port": monitor_port(job)}]},
    ]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["egress"] == [{"to": [WORLD]}, {"ports": kube.DNS}, STORE]


@pytest.mark.parametrize("text", [None, "", "  "])
def test_unset_settings_are_the_defaults(text) -> None:
    assert ps.parse(text) == ps.DEFAULT == ps.NetworkPolicySettings((), None)


def test_settings_as_the_chart_writes_them() -> None:
    text = json.dumps({"monitorFrom": [PROMETHEUS], "egress": [STORE]})
    assert ps.parse(text) == ps.NetworkPolicySettings((PROMETHEUS,), (STORE,))
    assert ps.parse(json.dumps({"monitorFrom": []})) == ps.DEFAULT
    assert ps.parse(json.dumps({"egress": []})).egress == ()  # restricted to world and DNS
    assert ps.parse("off") is None


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("{not json", "not JSON"),
        ("[]", "must be a JSON object or 'off'"),
        ('{"monitorFrom": [], "egres": []}', "egres: unknown field"),
        ('{"monitorFrom": {}}', "monitorFrom: must be a list of NetworkPolicyPeers"),
        (
            '{"monitorFrom": [{"podSelektor": {}}]}',
            "monitorFrom[0].podSelektor: unknown field (did you mean 'podSelector'?)",
        ),
        ('{"monitorFrom": [{}]}', "monitorFrom[0]: must not be empty: that admits everyone"),
        ('{"egress": [{"ports": [{"port": 1.5}]}]}', "egress[0].ports[0].port"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(text: str, said: str) -> None:
    with pytest.raises(ps.BadSettings) as e:
        ps.parse(text)
    assert str(e.value).startswith(f"{ps.POLICY_ENV}: ") and said in str(e.value)


def test_the_policy_comes_with_each_new_world_and_not_otherwise() -> None:
    obj = job_obj(trainers=2)
    first = reconcile.decide(obj, [], NOW, "img")
    assert first.create and first.policy == kube.network_policy(
        parse(obj), "ns", kube.owner_reference(obj), ps.DEFAULT
    )
    pods = [dict(p, status={"phase": "Running"}) for p in first.create]
    assert reconcile.decide(obj, pods, NOW, "img").policy is None  # the world stands
    off = reconcile.decide(obj, [], NOW, "img", policy=None)
    assert off.create and off.policy is None


def test_a_refused_policy_makes_no_pods_and_says_why_once() -> None:
    obj = job_obj(trainers=2)
    error = "PATCH .../networkpolicies/j: HTTP 422: the test operation failed"
    acts = api_refusals.without_policy(reconcile.decide(obj, [], NOW, "img"), {}, error, NOW)
    assert acts.create == [] and acts.policy is None and acts.status["phase"] == "Pending"
    created = next(c for c in acts.status["conditions"] if c["type"] == "Created")
    assert (created["status"], created["reason"]) == ("False", "NetworkPolicyRefused")
    assert "NetworkPolicy 'j'" in created["message"] and "HTTP 422" in created["message"]
    reasons = [e.reason for e in acts.events]
    assert "NetworkPolicyRefused" in reasons and "CreatedPods" not in reasons
    obj["status"] = acts.status
    again = api_refusals.without_policy(
        reconcile.decide(obj, [], NOW, "img"), acts.status, error, NOW
    )
    assert "NetworkPolicyRefused" not in [e.reason for e in again.events]


def _render(tmp_path, monkeypatch, capsys, setting: str | None) -> tuple[int, str, str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_obj("PipelineJob", stages=2)))
    if setting is not None:
        monkeypatch.setenv(ps.POLICY_ENV, setting)
    code = cli.main(["render", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_render_prints_the_policy_the_settings_make(tmp_path, monkeypatch, capsys) -> None:
    code, out, _ = _render(tmp_path, monkeypatch, capsys, json.dumps({"monitorFrom": [PROMETHEUS]}))
    docs = list(yaml.safe_load_all(out))
    assert code == 0 and [d["kind"] for d in docs][:2] == ["Service", "NetworkPolicy"]
    assert docs[1]["spec"]["ingress"][1]["from"] == [PROMETHEUS]
    assert "&id" not in out  # no YAML aliases: each part of the policy is its own
    code, out, _ = _render(tmp_path, monkeypatch, capsys, "off")
    assert code == 0 and "NetworkPolicy" not in out


def test_render_and_the_operator_refuse_bad_settings_before_anything(
    tmp_path, monkeypatch, capsys
) -> None:
    code, out, err = _render(tmp_path, monkeypatch, capsys, '{"monitorFrom": [{}]}')
    assert (code, out) == (2, "") and f"{ps.POLICY_ENV}: monitorFrom[0]" in err
    assert cli.main(["operator", "-n", "ns"]) == 2  # before kopf starts
    assert f"{ps.POLICY_ENV}: monitorFrom[0]" in capsys.readouterr().err
