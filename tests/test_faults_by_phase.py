"""Each role frozen (SIGSTOP) or killed (SIGKILL) in each phase of a local run (issue 19):
rendezvous, preflight, measuring, evaluation, checkpoint writing and output gathering, both
kinds (test_watchdog.py has the training phase). The run ends within its bound, naming the
member in one line; after a kill at a checkpoint, the next run resumes from the last one.

A phase is struck at the line that begins it: phases of a tiny world last a fraction of a
second, so the fault may land just after it. Each test prints the seconds from the fault to
the runner's verdict."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest
from test_watchdog import BOUND, _quiet, struck_run_ends

from harness.variants import exhaustive
from jobrun import JobRun, pipeline_job, run_to_end

# The preflight's check-in deadline bounds a member that stops before the world forms (the
# watchdog starts judging once the preflight passed): short, yet long enough for every
# process to load torch on a loaded machine.
CHECK_IN = 20


def pipeline(**fields: Any) -> dict[str, Any]:
    return pipeline_job(
        "fp",
        **{
            "stages": 2,
            "microBatches": 2,
            "batchSize": 4,
            "steps": 100000,
            "watchdog": {"seconds": BOUND},
            "preflight": {"megabytes": 0.25, "timeoutSeconds": CHECK_IN},
            **fields,
        },
    )


def hybrid(**fields: Any) -> dict[str, Any]:
    spec = {
        "trainers": 2,
        "steps": 100000,
        "batchSize": 8,
        "datasetSize": 256,
        "rendezvousTimeoutSeconds": 60,
        "watchdog": {"seconds": BOUND},
        "preflight": {"megabytes": 0.25, "timeoutSeconds": CHECK_IN},
    }
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "HybridJob",
        "metadata": {"name": "fh"},
        "spec": spec | fields,
    }


def line(member: str, said: str) -> str:
    """A pattern for a line that `member` prints (the runner prefixes each with its name)."""
    return rf"^{member}\s*\|.*{said}"


FAULTS = {
    # (manifest, member, signal, the line at which it strikes, what the runner says)
    "pipeline, rendezvous: a stage frozen before it checks in": (
        pipeline(),
        "stage1",
        signal.SIGSTOP,
        line("stage1", "performance settings"),
        # The master says it, or a stage that read its verdict first.
        r"(master|stage0) \(role \w+, rank \d\) failed: exit code 4: preflight: .*no answer"
        rf" within {CHECK_IN}s and \d+s more \(they start after the master's check\) from rank 2"
        r" \(stage1, role stage",
    ),
    "hybrid, rendezvous: the parameter server killed": (
        hybrid(),
        "ps0",
        signal.SIGKILL,
        line("ps0", "performance settings"),
        r"ps0 \(role ps, rank 1\) failed: killed by signal SIGKILL",
    ),
    "pipeline, preflight: the master frozen": (
        pipeline(),
        "master",
        signal.SIGSTOP,
        line("master", "checked in after"),
        # Named by a stage, whether or not one of its heartbeats was answered before.
        r"stage\d \(role stage, rank \d\) failed: exit code 6: stalled: master (\(pid {pid}\) )?"
        r"stopped answering: no reply to heartbeats for \d+ s",
    ),
    "pipeline, measuring: a stage killed": (
        pipeline(),
        "stage0",
        signal.SIGKILL,
        line("master", r"measur\w* what each part costs"),
        r"stage0 \(role stage, rank 1\) failed: killed by signal SIGKILL",
    ),
    "pipeline, evaluation and output at the end: a stage frozen": (
        pipeline(steps=3, eval={"batches": 20}, output={"path": "{tmp}/model"}),
        "stage1",
        signal.SIGSTOP,
        line("master", "step 3/3"),
        r"master \(role master, rank 0\) failed: exit code 6: stalled: stage1 \(pid {pid}\)"
        r" stopped answering: no heartbeat for \d+ s",
    ),
    "hybrid, evaluation: the trainer that evaluates frozen": (
        hybrid(eval={"everySteps": 5}),
        "trainer0",
        signal.SIGSTOP,
        line("master", "eval step 5"),
        r"master \(role master, rank 0\) failed: exit code 6: stalled: trainer0 \(pid {pid}\)"
        r" stopped answering: no heartbeat for \d+ s",
    ),
    "hybrid, checkpoint writing: the master frozen": (
        hybrid(checkpoint={"path": "{tmp}/ckpt", "everySteps": 5}),
        "master",
        signal.SIGSTOP,
        line("master", "checkpoint of step 5"),
        r"(ps\d|trainer\d) \(role \w+, rank \d\) failed: exit code 6: stalled: master \(pid {pid}\)"
        r" stopped answering: no reply to heartbeats for \d+ s",
    ),
}


def placed(manifest: dict[str, Any], tmp: str) -> dict[str, Any]:
    """The manifest with its paths under the test's directory."""
    spec = {
        k: (
            {f: v.format(tmp=tmp) if isinstance(v, str) else v for f, v in value.items()}
            if k in ("output", "checkpoint")
            else value
        )
        for k, value in manifest["spec"].items()
    }
    return {**manifest, "spec": spec}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "fault",
    exhaustive(
        FAULTS,
        {
            "hybrid, rendezvous: the parameter server killed",
        },
    ),
)
def test_a_fault_in_each_phase_ends_the_run_naming_the_member(fault, tmp_path):
    manifest, member, sig, after, verdict = FAULTS[fault]
    said, reacted = struck_run_ends(
        placed(manifest, str(tmp_path)), member, sig, after, verdict, tmp_path, wait=90
    )
    print(
        f"{fault}: {signal.Signals(sig).name} of {member}, verdict after {reacted:.1f} s"
        f" (bound {BOUND} s): {said.string}"
    )


@pytest.mark.slow  # test_checkpoint.py: an interrupted checkpoint is never used
@pytest.mark.timeout(300)
def test_a_stage_killed_while_checkpointing_and_the_next_run_resumes_from_the_last_one(
    tmp_path,
):
    manifest = pipeline(checkpoint={"path": str(tmp_path / "ckpt"), "everySteps": 2})
    with JobRun(manifest, tmp_path) as run:
        run.wait_for(line("master", "checkpoint of step 2"), timeout=180)
        pid = run.pid("stage0")
        os.kill(pid, signal.SIGKILL)
        struck = time.monotonic()
        run.wait_for(r"stage0 \(role stage, rank 1\) failed: killed by signal SIGKILL", 60)
        reacted = time.monotonic() - struck
        assert run.finish(timeout=60) != 0
    _quiet(run.output)
    saved = [int(s) for s in re.findall(r"checkpoint of step (\d+)", run.output)]
    last = max(saved)
    # The run again, to a few steps past its last checkpoint: it resumes there.
    again = {**manifest, "spec": {**manifest["spec"], "steps": last + 2}}
    code, output, summary = run_to_end(again, tmp_path, timeout=180)
    assert code == 0, output
    assert f"resumed from step {last} " in output
    assert summary is not None and summary["resumedFromStep"] == last
    print(
        f"stage0 killed at the checkpoint of step 2: verdict after {reacted:.1f} s; the next"
        f" run resumed from step {last}"
    )
