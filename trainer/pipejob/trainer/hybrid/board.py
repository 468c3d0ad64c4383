"""What a HybridJob's master hears from its trainers while they train, and the functions
they call on it over RPC: each step's loss (`report`), an evaluation (`evaluated`) and a
checkpoint to complete (`write_manifest`). master.py starts the trainers' loops, trainer.py
calls these: both import this module, neither imports the other's."""

from __future__ import annotations

import threading
import time

from pipejob.trainer.hybrid import model_writer
from pipejob.trainer.hybrid.records import Evaluation, FileEntry, HeldOutFigures
from pipejob.trainer.runtime import checkpoint, memory, monitor, roles, world
from pipejob.trainer.runtime.events import Events
from pipejob.trainer.runtime.world import Env


class Reports:
    """Prints one line per logged step once every trainer has reported it, and each
    evaluation; keeps the latest evaluation for the summary and the checkpoints."""

    def __init__(self, env: Env, trainers: list[str], first: int = 0, samples: int = 0):
        self.env, self.trainers, self.first = env, trainers, first
        self.samples = samples  # of the data's stream, read before step `first`
        self.steps = env.spec.steps
        self.batch = env.spec.batch_size * env.spec.trainers.max  # a step's, at any count
        self.lock = threading.Lock()
        self.pending: dict[int, dict[str, float]] = {}
        self.created = time.perf_counter()
        self.last_step, self.last_time = first, self.created
        self.evaluation: Evaluation | None = None  # the latest, with its step
        self.losses: dict[int, float] = {}  # the batch's loss at each logged step
        logging = env.spec.logging
        self.events = Events(logging.tensorboard if logging else None, first)

    def evaluated(self, step: int, figures: HeldOutFigures) -> None:
        """DDP rank 0 evaluated the model after `step` on held-out samples."""
        loss, accuracy, auc = figures.loss, figures.accuracy, figures.auc
        with self.lock:
            self.evaluation = Evaluation(
                evalStep=step,
                evalLoss=loss,
                evalAccuracy=accuracy,
                evalAuc=auc,
                evalSamples=figures.samples,
            )
        world.log(
            self.env,
            f"eval step {step}: {evaluation_text(loss, accuracy, auc)} on {figures.samples}"
            f" held-out {sample_noun()}",
        )
        monitor.board().evaluated(step, loss, accuracy=accuracy, auc=auc)
        with self.lock:
            self.events.scalars(step, eval_loss=loss, eval_accuracy=accuracy, eval_auc=auc)

    def report(self, trainer: str, step: int, loss: float) -> None:
        with self.lock:
            losses = self.pending.setdefault(step, {})
            losses[trainer] = loss
            if len(losses) < len(self.trainers):
                return
            del self.pending[step]
            now = time.perf_counter()
            if step == self.first:  # every trainer is set up and about to take a step
                world.log(self.env, f"trainers ready after {now - self.created:.1f}s of setup")
            elif step > self.last_step:
                samples = self.batch * (step - self.last_step)
                rate = samples / max(now - self.last_time, 1e-9)
                mean = sum(losses.values()) / len(losses)  # weighted by share: the batch's
                self.losses[step] = mean
                world.log(
                    self.env, f"step {step}/{self.steps}  loss {mean:.4f}  {rate:,.0f} samples/s"
                )
                steps = step - self.last_step
                monitor.board().step(step, mean, (now - self.last_time) / steps, samples // steps)
                memory.refresh(self.env, monitor.board())  # each member's peak, not waited for
                self.events.scalars(step, loss=mean, samples_per_second=rate)
            else:
                return
            self.last_step, self.last_time = step, now


def evaluation_text(loss: float, accuracy: float | None, auc: float | None) -> str:
    """An evaluation's figures in words: `loss 0.4321, AUC 0.7712` (clicks) or `loss 0.1234,
    accuracy 95.0%` (spec.embedding's classes)."""
    words = f"loss {loss:.4f}"
    if accuracy is not None:
        words += f", accuracy {100 * accuracy:.1f}%"
    if auc is not None:
        words += f", AUC {auc:.4f}"
    return words


def sample_noun() -> str:
    """What the job's samples are called: bags (spec.embedding) or samples."""
    return "bags" if world.current().spec.embedding is not None else "samples"


# The master's reports board, fed by the trainers over RPC.
_REPORTS: Reports | None = None


def open_reports(env: Env, trainers: list[str], first: int, samples: int = 0) -> Reports:
    global _REPORTS
    _REPORTS = Reports(env, trainers, first, samples)
    return _REPORTS


def _master_reports() -> Reports:
    assert _REPORTS is not None, "a trainer's report reached a process that is not the master"
    return _REPORTS


def report(trainer: str, step: int, loss: float) -> None:
    """Runs on the master: a trainer finished `step` with `loss`."""
    _master_reports().report(trainer, step, loss)


def evaluated(step: int, figures: HeldOutFigures) -> None:
    """Runs on the master: DDP rank 0's evaluation after `step` (evaluate.evaluate)."""
    _master_reports().evaluated(step, figures)


def write_manifest(step: int, files: list[FileEntry], seconds: float) -> None:
    """Runs on the master (called by DDP rank 0): complete the checkpoint of `step`."""
    env = world.current()
    start = time.perf_counter()
    reports = _master_reports()
    samples = reports.samples + (step - reports.first) * reports.batch  # the data's position
    own = checkpoint.save_part(
        checkpoint.step_dir(env.spec.checkpoint.path, step),
        "master.pt",
        {"rng": checkpoint.rng_state(), "data": {"samples": samples}},
    )
    # The model's spec and latest evaluation travel along, for `pipejob export`.
    roles.complete_checkpoint(
        env,
        step,
        [own, *files],
        seconds + time.perf_counter() - start,
        trainerCount=len(env.names("trainer")),
        parameterServers=env.spec.parameter_servers,
        model=model_writer.model_spec(env.spec),
        metrics=model_writer.metrics(reports.evaluation),
    )
