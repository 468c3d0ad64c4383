"""`microBatches: auto`'s choice: each candidate count's predicted step from its measured
(or counted) costs, and the table of them the summary, the log and the checkpoint keep.
The cut that measures them: pipeline/cut_model.py; the predictions: balance.py and
counted_cost.py."""

from __future__ import annotations

from pipejob.trainer.pipeline.balance import Host, Prediction, UnitCosts, predict
from pipejob.trainer.pipeline.counted_cost import predict_counted
from pipejob.trainer.pipeline.run_json import Candidate


def prediction(
    costs: UnitCosts,
    stages: int,
    micro_batches: int,
    batch: int,
    hosts: list[Host],
    fixed: list[range] | None = None,
    per_process: int = 1,
    starts: list[bool] | None = None,
) -> Prediction:
    """`micro_batches`' predicted step from the `costs` of one of its micro-batches: timed,
    given the `hosts` whose cores the stages share (balance.predict); counted
    (spec.deterministic), from the counts alone (counted_cost.predict_counted), so every
    machine, busy or idle, large or small, predicts alike and `auto` chooses alike."""
    if costs.counted:
        return predict_counted(costs, stages, micro_batches, batch, fixed, per_process, starts)
    return predict(costs, stages, micro_batches, batch, hosts, fixed, per_process, starts)


def candidate(p: Prediction) -> Candidate:
    """One row of `microBatches: auto`'s table, as the summary and the checkpoint keep it:
    timed, both bounds of the step in seconds; counted (spec.deterministic), the step's
    count (counted_cost.predict_counted: FLOPs and bytes, not seconds)."""
    row = Candidate(microBatches=p.micro_batches, microBatchSize=p.micro_batch_size)
    if p.counted:
        row["predictedStepCount"] = p.step_seconds
        return row
    row["pipelineBoundSeconds"] = round(p.pipeline_seconds, 4)
    row["coresBoundSeconds"] = round(p.cores_seconds, 4)
    row["predictedStepSeconds"] = round(p.step_seconds, 4)
    row["predictedSamplesPerSecond"] = round(p.samples_per_second, 2)
    return row


def candidate_table(candidates: list[Candidate], chosen: int) -> str:
    """Per candidate: both bounds of the step (see balance.predict), the prediction; or,
    counted, the step's count in GFLOP-equivalents."""
    counted = "predictedStepCount" in candidates[0]
    lines = [
        f"  {'m':>3} {'micro':>5} {'predicted step, G counted':>25}"
        if counted
        else f"  {'m':>3} {'micro':>5} {'pipeline s':>10} {'cores s':>7}"
        f" {'predicted s/step':>16} {'samples/s':>9}"
    ]
    for c in candidates:
        mark = "  <- chosen" if c["microBatches"] == chosen else ""
        row = f"  {c['microBatches']:>3} {c['microBatchSize']:>5}"
        if counted:
            lines.append(f"{row} {c['predictedStepCount'] / 1e9:>25.2f}{mark}")
            continue
        lines.append(
            f"{row} {c['pipelineBoundSeconds']:>10.3f} {c['coresBoundSeconds']:>7.3f}"
            f" {c['predictedStepSeconds']:>16.3f}"
            f" {c['predictedSamplesPerSecond']:>9.1f}{mark}"
        )
    return "\n".join(lines)
