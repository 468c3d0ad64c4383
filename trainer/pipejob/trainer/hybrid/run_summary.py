"""A HybridJob run's summary: losses, rates, the held-out evaluation, the tables' servers,
and checks that the trainers' dense replicas agree and read no sample twice in one pass."""

from __future__ import annotations

import math
from typing import cast

from pipejob.trainer.hybrid.board import evaluation_text, sample_noun
from pipejob.trainer.hybrid.records import (
    Evaluation,
    HybridSummary,
    ServerCounts,
    ServerFigures,
    TrainerFigures,
    TrainerResults,
)
from pipejob.trainer.runtime import memory, monitor, roles
from pipejob.trainer.runtime.world import Env


def summarize(
    env: Env,
    results: dict[str, TrainerResults],
    servers: dict[str, ServerFigures],
    first: int,
    evaluation: Evaluation | None = None,
) -> HybridSummary:
    """The run's summary from each trainer's results (trainer.train), each server's figures
    (ps.Server.figures), the step the run resumed from and the last held-out evaluation, if
    any. Asks every member of the world for its peak memory (runtime/memory.py)."""
    peaks = memory.gather(env)
    for member, figures in peaks.items():
        monitor.board().memory(member, figures)  # the last /progress report has them too
    names = list(results)
    # The dense weights and the replicated tables: the same on every trainer.
    held = {n: {**r.dense, **r.replicated} for n, r in results.items()}
    dense_diff = max(
        (w - held[names[0]][k]).abs().max().item() for h in held.values() for k, w in h.items()
    )
    # (epoch, sample) pairs: a sample read twice in one pass over the data is a repeat.
    read = [{tuple(pair) for pair in r.read.tolist()} for r in results.values()]
    repeated = sum(len(s) for s in read) - len(set().union(*read))
    trained = {name: r.figures for name, r in results.items()}
    seconds = max(t["seconds"] for t in trained.values())
    samples = sum(t["steps"] * t["share"] for t in trained.values())
    summary = roles.summary(
        env,
        env.spec.steps - first,
        first,
        trainers=len(names),
        parameterServers=len(servers),
        batchSize=env.spec.batch_size,
        seconds=seconds,
        samplesPerSecond=samples / seconds,
        # Each trainer's loss is weighted by its share of the batch: their mean is the batch's.
        firstLoss=sum(t["firstLoss"] for t in trained.values()) / len(names),
        finalLoss=sum(t["finalLoss"] for t in trained.values()) / len(names),
        denseMaxAbsDiff=dense_diff,
        embeddingNormBefore=math.sqrt(sum(s["initialSquares"] for s in servers.values())),
        embeddingChangeNorm=math.sqrt(sum(s["changeSquares"] for s in servers.values())),
        samplesRepeated=repeated,
        **(evaluation or {}),
        perTrainer=trained,
        perServer={
            name: ServerCounts(rowsUpdated=s["rowsUpdated"], steps=s["steps"])
            for name, s in servers.items()
        },
        memory=peaks,
    )
    return cast(HybridSummary, summary)  # roles.summary: its keys, then these


def render(s: HybridSummary) -> list[str]:
    """The summary's lines, as the master logs them."""
    lines = [
        f"done: {s['steps']} steps x {s['batchSize']} {sample_noun()} on {s['trainers']} trainer(s)"
        f" in {s['seconds']:.2f}s, {s['samplesPerSecond']:,.0f} samples/s",
        f"loss {s['firstLoss']:.4f} -> {s['finalLoss']:.4f} (mean over trainers)",
        f"dense replicas: max |difference| across trainers {s['denseMaxAbsDiff']:.3g}",
        f"tables on {s['parameterServers']} parameter server(s): changed by"
        f" {s['embeddingChangeNorm']:.4g} since initialization (norm of the change; norm at"
        f" initialization {s['embeddingNormBefore']:.4g}); rows updated "
        + ", ".join(f"{name} {v['rowsUpdated']:,}" for name, v in s["perServer"].items()),
        f"data: samples read twice in one pass over the data: {s['samplesRepeated']}"
        + _reader_peaks(s["perTrainer"]),
        *(
            [
                f"held-out: {evaluation_text(s['evalLoss'], s['evalAccuracy'], s['evalAuc'])}"
                f" on {s['evalSamples']} {sample_noun()} (after step {s['evalStep']})"
            ]
            if s.get("evalLoss") is not None
            else []
        ),
        "peak memory: "
        + ", ".join(f"{name} {memory.megabytes(peak)}" for name, peak in s["memory"].items()),
        f"{'trainer':<10} {'ddp':>3} {'loss first -> final':>20} {'samples/s':>10}"
        f" {'share':>9} {'read':>7} {'dense moved':>11}",
    ]
    for name, t in s["perTrainer"].items():
        lines.append(
            f"{name:<10} {t['ddpRank']:>3} {t['firstLoss']:>9.4f} -> {t['finalLoss']:<7.4f}"
            f" {t['samplesPerSecond']:>10,.0f} {t['share']:>9} {t['samplesRead']:>7}"
            f" {t['denseChangeNorm']:>11.4g}"
        )
    return lines


def _reader_peaks(trainers: dict[str, TrainerFigures]) -> str:
    """Click logs' readers: the most they held at once, whatever the logs' size."""
    peaks = {
        name: t["readerPeakBytes"]
        for name, t in trainers.items()
        if t.get("readerPeakBytes") is not None
    }
    if not peaks:
        return ""
    held = ", ".join(f"{name} {peak / 1e6:.1f} MB" for name, peak in peaks.items())
    return f"; lines the readers held at most: {held}"
