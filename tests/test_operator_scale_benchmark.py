"""benchmarks/operator_scale.py runs at its own default shapes, both kinds, and a job that would
be refused, by pipejob's validation before the run or by the operator during it, ends the run
at once saying which and why (issue 60: it waited 120 s and ended in a traceback)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import operator_scale

pytestmark = pytest.mark.timeout(180)

RESNET_32 = {"model": "resnet18", "stages": 32, "steps": 3}


def resnet(name: str, shape: str) -> dict:
    """What the benchmark made before issue 60: a 32-stage ResNet-18, which cannot be cut so."""
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": name},
        "spec": RESNET_32,
    }


def test_every_default_shape_is_a_job_pipejob_accepts() -> None:
    assert operator_scale.refusal(["2", "8", "32", "hybrid"]) is None
    assert len(operator_scale.pod_names("j", "32")) == 33
    assert operator_scale.pod_names("j", "hybrid") == [
        "j-master-0",
        "j-ps-0",
        "j-trainer-0",
        "j-trainer-1",
    ]


def test_a_job_pipejob_refuses_stops_the_run_before_it_starts_saying_why(monkeypatch, capsys):
    monkeypatch.setattr(operator_scale, "manifest", resnet)
    assert operator_scale.main(["--jobs", "1", "--sizes", "32", "--scale", "0"]) == 2
    said = capsys.readouterr().out
    assert "stopped before starting: a 32 job is refused:" in said
    assert "resnet18 has 14 places to cut" in said, said


def test_a_job_the_operator_fails_stops_the_run_at_once_naming_it(monkeypatch, capsys):
    monkeypatch.setattr(operator_scale, "manifest", resnet)
    monkeypatch.setattr(operator_scale, "refusal", lambda shapes: None)
    monkeypatch.setattr(operator_scale, "pod_names", lambda name, shape: [f"{name}-master-0"])
    args = ["--jobs", "1", "--sizes", "32", "--scale", "0", "--timeout", "100"]
    assert operator_scale.main(args) == 2
    said = capsys.readouterr().out
    assert "stopped: the operator failed PipelineJob s32-0:" in said
    assert "resnet18 has 14 places to cut" in said, said


def test_a_pipelinejobs_stage_pods_come_once_the_stand_in_master_reports_it_checked(capsys):
    """The operator makes a PipelineJob's stage pods once a /progress poll finds its master past
    its check (operator/master_check.py): the benchmark's stand-in master at every pod's podIP
    says so, so they come at its first poll (0.2 s after it runs), not after the operator's 60 s
    fallback for a master never read (the run's --timeout is under it)."""
    args = ["--jobs", "1", "--sizes", "2", "--scale", "0", "--timeout", "40"]
    assert operator_scale.main(args) == 0, capsys.readouterr().out
    said = capsys.readouterr().out
    assert "2-stage (3 pods): the operator's own" in said
    assert "2-stage (3 pods): all pods" in said, said
