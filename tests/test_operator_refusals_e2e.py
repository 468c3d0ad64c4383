"""The operator's side of issue 11 on the emulated cluster: a spec that passes the CRD but only
the operator can refuse fails with InvalidSpec before any pod exists; a trainer that fails
permanently fails its job after one attempt (restarts 0, the trainer's reason and message);
a retryable failure still restarts the world (tests/test_operator_e2e.py kills a stage)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import jobs
from harness.client import Api
from harness.kubelet import Kubelet

pytestmark = pytest.mark.timeout(240)

NS = "default"


def pipeline(name: str, **spec) -> dict:
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": name},
        "spec": {
            "model": "resnet18",
            "stages": 2,
            "steps": 3,
            "batchSize": 4,
            "imageSize": 32,
            "numClasses": 10,
            "microBatches": 2,
            "rendezvousTimeoutSeconds": 60,
            **spec,
        },
    }


def failed_condition(job: dict) -> dict:
    return next(c for c in job["status"]["conditions"] if c["type"] == "Failed")


@pytest.mark.parametrize(
    ("template", "path"),
    [
        (
            {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]},
            "spec.template.volumes[0].hostPath",
        ),
        ({"env": [{"name": "MASTER_ADDR", "value": "evil.example"}]}, "spec.template.env[0].name"),
    ],
    ids=["hostpath", "reserved-env"],
)
def test_a_spec_only_the_operator_refuses_fails_before_any_pod(cluster, operator, template, path):
    api: Api = cluster.api
    name = "refused"
    jobs.create(api, pipeline(name, template=template))  # the CRD admits it
    failed = jobs.wait_phase(api, "PipelineJob", name, "Failed", timeout=30)
    condition = failed_condition(failed)
    assert condition["reason"] == "InvalidSpec" and path in condition["message"]
    assert jobs.pods(api, name) == []
    events = [e for e in api.list("v1/events", NS) if e["involvedObject"]["name"] == name]
    assert "CreatedPods" not in {e["reason"] for e in events}  # no pod, ever


def test_a_permanent_trainer_failure_fails_the_job_after_one_attempt(
    cluster, kubelet: Kubelet, operator, tmp_path: Path
):
    api: Api = cluster.api
    # An image whose torchvision is broken, as far as the trainer can tell.
    broken = tmp_path / "site"
    (broken / "torchvision").mkdir(parents=True)
    (broken / "torchvision" / "__init__.py").write_text(
        "raise ImportError('torchvision is broken in this image')\n"
    )
    env = [{"name": "PYTHONPATH", "value": str(broken)}]
    name = "broken"
    jobs.create(api, pipeline(name, backoffLimit=3, template={"env": env}))
    failed = jobs.wait_phase(api, "PipelineJob", name, "Failed", timeout=180)
    assert failed["status"]["restarts"] == 0
    condition = failed_condition(failed)
    assert condition["reason"] == "ImportFailed", condition
    assert "torchvision is broken in this image" in condition["message"]
    worlds = {r.pod["metadata"]["labels"]["pipejob.dev/restart"] for r in kubelet.runs(NS)}
    assert worlds == {"0"}  # one attempt, no restart spent
    api.wait("every pod process to be gone", lambda: not kubelet.running(), 30)


@pytest.mark.slow  # the permanent failure above; test_nonfinite.py says where
def test_a_run_that_goes_non_finite_fails_permanently_saying_where(
    cluster, kubelet: Kubelet, operator
):
    """Issue 30: a user's model that returns NaN in step 2 (tests/userpkg/blowup.py) fails
    the job within that step, without a restart (a restart would only reach it again), its
    reason NonFinite and its message naming the step, the stage and the value."""
    api: Api = cluster.api
    name = "nonfinite"
    model = {"import": "userpkg.blowup:cnn", "args": {"at": 2, "micro_batches": 2}}
    env = [{"name": "PYTHONPATH", "value": str(Path(__file__).parent)}]  # userpkg
    jobs.create(
        api,
        pipeline(
            name,
            engine="rpc",  # the rpc engine's stop (test_nonfinite.py: the pipelining engine's)
            model=model,
            splitPoints=["8"],
            backoffLimit=3,
            template={"env": env},
        ),
    )
    failed = jobs.wait_phase(api, "PipelineJob", name, "Failed", timeout=180)
    assert failed["status"]["restarts"] == 0
    condition = failed_condition(failed)
    assert condition["reason"] == "NonFinite", condition
    assert "step 2: the loss is nan, first non-finite in stage0's forward" in condition["message"]
    api.wait("every pod process to be gone", lambda: not kubelet.running(), 30)


def test_a_shipped_gpt_without_a_loss_is_refused_before_any_other_pod_exists(
    cluster, kubelet: Kubelet, operator, tmp_path: Path
):
    """Issue 56 on a cluster: a GPT's shipped forward (tests/userpkg/gpt_forwards.py, its
    `(logits, None)` without targets) and no spec.loss. The operator makes the master's pod
    alone (no gang scheduler: operator/master_check.py); its check refuses the default loss,
    and the job fails InvalidConfiguration naming spec.loss and what to give, after one
    attempt, with no other pod ever made."""
    api: Api = cluster.api
    name = "gpt"
    tokens = tmp_path / "tokens.bin"  # the process-kubelet's pods share this host
    tokens.write_bytes(b"".join((i % 64).to_bytes(2, "little") for i in range(4096)))
    env = [{"name": "PYTHONPATH", "value": str(Path(__file__).parent)}]  # userpkg
    manifest = pipeline(
        name,
        model={"import": "userpkg.gpt_forwards:nanogpt"},
        data={"tokens": {"train": str(tokens), "seqLen": 16}},
        eval={"everySteps": 0},
        batchSize=8,
        backoffLimit=3,
        template={"env": env},
    )
    for key in ("imageSize", "numClasses"):  # the resnet's
        del manifest["spec"][key]
    jobs.create(api, manifest)
    failed = jobs.wait_phase(api, "PipelineJob", name, "Failed", timeout=180)
    assert failed["status"]["restarts"] == 0
    condition = failed_condition(failed)
    assert condition["reason"] == "InvalidConfiguration", condition
    said = condition["message"]
    assert "master 0 (pod gpt-master-0) failed permanently" in said, said
    assert "spec.loss: the model returns ((2, 1, 64) float32, None)" in said, said
    assert "give spec.loss: {import: mypkg.losses:build}" in said, said

    def said_in() -> dict[str, str]:
        events = [e for e in api.list("v1/events", NS) if e["involvedObject"]["name"] == name]
        return {e["reason"]: e["message"] for e in events}

    # The Event may be posted just after the status that failed the job.
    api.wait("the refusal's Event", lambda: "InvalidConfiguration" in said_in(), 30)
    assert "give spec.loss" in said_in()["InvalidConfiguration"], said_in()
    assert said_in()["CreatedPods"] == "created pods gpt-master-0", said_in()
    api.wait("every pod process to be gone", lambda: not kubelet.running(), 30)
    assert [p["metadata"]["name"] for p in jobs.pods(api, name)] == ["gpt-master-0"]
    assert [r.name for r in kubelet.runs(NS)] == ["gpt-master-0"]  # no other pod ever ran
