"""`pipejob run` of a manifest in the background, for tests that watch a world as it runs.

Lines of output arrive as they are printed, the pids the runner reports are at hand (to kill
a member on purpose), and leaving the `with` block stops everything that is still running,
whatever the test did. And one training step of a job through a real pipeline world against
the same step in one process (`check_gradients`)."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import yaml

from pipejob.core import plan, spec
from pipejob.runner.local import LOOPBACK, free_ports
from pipejob.trainer import pipeline, workloads
from pipejob.trainer.pipeline import engine_choice
from pipejob.trainer.pipeline.cut_model import plan_cut
from pipejob.trainer.pipeline.rpc.driver import RpcPipeline, forward_backward
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.pipeline.step_records import NOTHING
from pipejob.trainer.runtime import checkpoint, rendezvous, world
from pipejob.trainer.workloads import cut, data, models
from pipejob.trainer.workloads.cut import join

STARTED = re.compile(r"^pipejob: started (\S+) \(rank \d+, pid (\d+)\)$", re.M)

# A pipeline small enough for 2 CPU cores; each test adds the fields it depends on.
SMALL_PIPELINE = {
    "model": "resnet18",
    "batchSize": 8,
    "imageSize": 32,
    "numClasses": 10,
    "rendezvousTimeoutSeconds": 60,
}


def pipeline_job(name: str, **fields: Any) -> dict[str, Any]:
    """A PipelineJob manifest: the small pipeline with `fields` over it."""
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": name},
        "spec": SMALL_PIPELINE | fields,
    }


class JobRun:
    def __init__(
        self,
        manifest: dict[str, Any],
        directory: Path,
        name: str = "job",
        args: tuple[str, ...] = (),
    ):
        """`pipejob run` of `manifest` with `args` (e.g. ("--size", "2"))."""
        path = directory / f"{name}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        self.summary_file = directory / f"{name}.summary.json"
        self.summary_file.unlink(missing_ok=True)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "pipejob.cli", "run", str(path), "--grace", "5", *args],
            env=os.environ | {"PIPEJOB_SUMMARY_FILE": str(self.summary_file)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._new: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._new.put(line.rstrip("\n"))
        self._new.put(None)

    def _take(self, timeout: float) -> bool:
        """Move newly printed lines to `lines`; False once the output has ended."""
        try:
            line = self._new.get(timeout=timeout)
        except queue.Empty:
            return True
        while line is not None:
            self.lines.append(line)
            try:
                line = self._new.get_nowait()
            except queue.Empty:
                return True
        self._new.put(None)  # keep the end marker for later calls
        return False

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first output line matching `pattern`, waiting up to `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for line in self.lines[seen:]:
                if match := re.search(pattern, line):
                    return match
            seen = len(self.lines)
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"no line matching {pattern!r} within {timeout}s:\n" + self.output
                )
            if not self._take(min(left, 0.5)) and seen == len(self.lines):
                raise AssertionError(
                    f"the run ended without a line matching {pattern!r}:\n" + self.output
                )

    def pid(self, name: str) -> int:
        pids = {m[1]: int(m[2]) for m in STARTED.finditer(self.output)}
        return pids[name]

    def finish(self, timeout: float) -> int:
        """The runner's exit code once it ended (it stops its world first)."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"pipejob run did not end within {timeout}s:\n" + self.output
            ) from None
        self._drain()
        return self.popen.returncode

    def _drain(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self._take(0.2) and time.monotonic() < deadline:
            pass

    def summary(self) -> dict[str, Any]:
        return json.loads(self.summary_file.read_text())

    def __enter__(self) -> JobRun:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)  # the runner stops its world on SIGTERM
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._drain()
        for match in STARTED.finditer(self.output):  # nothing may outlive the test
            try:
                os.killpg(int(match[2]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_to_end(
    manifest: dict[str, Any], directory: Path, timeout: float
) -> tuple[int, str, dict[str, Any] | None]:
    """`pipejob run` to its end: exit code, output, and the master's summary (None if none)."""
    with JobRun(manifest, directory) as run:
        code = run.finish(timeout)
    summary = run.summary() if run.summary_file.exists() else None
    return code, run.output, summary


def run_world(target: Any, envs: list[dict[str, str]], out: Path, timeout: float = 150) -> Any:
    """Run `target(rank, envs, out)` in one spawned process per env of a world plan, wait for
    all of them (killing what is left after `timeout` seconds), and load what it saved."""
    import torch.multiprocessing as mp

    context = mp.start_processes(
        target, args=(envs, str(out)), nprocs=len(envs), join=False, start_method="spawn"
    )
    try:
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, f"the world did not finish in {timeout:g} s"
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
            p.join(10)
    return torch.load(out)


# ------------------------------------------------------------ one step against one process


def _stage_gradients(stage: rpc.RRef, context_id: int) -> dict[str, torch.Tensor]:
    """Runs on a stage: the gradients its pieces got in one step, by every name of every
    parameter (a tied one's too), wherever its engine keeps them (StageBase.gradients)."""
    held = stage.local_value()
    params = dict(held.layers.named_parameters())
    by_tensor = {id(params[n]): g for n, g in held.gradients(context_id).items()}
    return {
        name: by_tensor.get(id(p))
        for name, p in held.layers.named_parameters(remove_duplicate=False)
    }


def master_of(rank: int, envs: list[dict[str, str]]) -> world.Env | None:
    """Process `rank` of a spawned pipeline world: a stage runs the trainer's own stage role
    to its end (None); the master joins the RPC world and gets its env, for the test to drive
    and then `rpc.shutdown()`."""
    os.environ.update(envs[rank])
    env = world.read_env()
    if env.role != "master":
        pipeline.run(env)
        return None
    rendezvous.join_rpc(env)
    return env


def _gradient_world(rank: int, envs: list[dict[str, str]], out: str) -> None:
    """One process of a real pipeline world: the master runs one step's forwards and
    backwards with the trainer's building blocks (on the job's engine; every replica on its
    share of the batch, their gradients averaged) and saves replica 0's gradients; once per
    schedule listed in `<out>.schedules.json` (pipelining: the same stage processes run
    each, one after the other), else once."""
    if (env := master_of(rank, envs)) is None:
        return
    try:
        torch.set_default_dtype(EXACT)  # the model and the data; the stages get them as built
        listed = Path(f"{out}.schedules.json")
        variants = json.loads(listed.read_text()) if listed.exists() else [{}]
        runs = []
        for variant in variants:
            s = dataclasses.replace(env.spec, **variant)
            with data.Feed(s) as feed:
                batch = feed.batch()
            every = env.names("stage")
            cut_model = plan_cut(s, *models.build_meta(s), every[: s.stages])
            if cut_model.partition.engine is not None:  # engine auto: the engine the cut chose
                s = engine_choice.resolved(s, cut_model.partition.engine.engine)
            if s.engine == "rpc":
                pipe, loss, grads = _rpc_step(s, every[: s.stages], cut_model, batch)
            else:
                pipe, loss, grads = _pipelining_step(s, every, cut_model, batch)
            runs.append(
                {
                    "loss": loss,
                    "grads": grads,
                    "variant": variant,
                    "stages": [cut_model.piece_units(i) for i in range(len(cut_model.ranges))],
                    "states": pipe.stage_results(StageBase.state),
                    "rest": cut_model.rest,
                    "config": cut_model.config,
                }
            )
        torch.save(runs, out)
    finally:
        rpc.shutdown()


def _rpc_step(s: Any, names: list[str], cut_model: Any, batch: Any) -> tuple[Any, float, dict]:
    pipe = RpcPipeline(names, cut_model, "cpu", s.precision, s.activation_checkpointing)
    with dist_autograd.context() as context_id:
        loss, _ = forward_backward(
            pipe, pipe.read(s.micro_batches, batch), 0, context_id, workloads.loss(s)
        )
        pipe.combine_tied(context_id, cut_model.tied)
        return pipe, loss.item(), _gradients(pipe, context_id)


def _pipelining_step(
    s: Any, names: list[str], cut_model: Any, batch: Any
) -> tuple[Any, float, dict]:
    """Every replica's share through its pipeline at once (their gradients are averaged
    by a collective every replica's stage i joins), replica 0's gradients."""
    from concurrent.futures import ThreadPoolExecutor

    from pipejob.trainer.pipeline.pipelining import driver

    pipes = [
        driver.PipeliningPipeline(names[r * s.stages : (r + 1) * s.stages], cut_model, s)
        for r in range(s.replicas.max)
    ]
    shares = list(zip(*(t.tensor_split(s.replicas.max) for t in batch), strict=True))

    def one(r: int) -> float:
        pipe = pipes[r]
        batch = pipe.read(s.micro_batches, shares[r])
        sent = pipe.launch(batch, range(0, 1), workloads.loss(s), 1.0, [NOTHING])
        loss, _, _ = driver.outcome([replies[0] for replies in torch.futures.wait_all(sent)])
        pipe.combine_tied(0, cut_model.tied)
        if s.replicas.max > 1:
            pipe.stage_results(StageBase.average_gradients, 0)
        return loss

    with ThreadPoolExecutor(s.replicas.max) as threads:
        losses = list(threads.map(one, range(s.replicas.max)))
    return pipes[0], sum(losses) / len(losses), _gradients(pipes[0], 0)


def _gradients(pipe: Any, context_id: int) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    for stage in pipe.stages:
        grads |= rpc.rpc_sync(stage.name, _stage_gradients, args=(stage, context_id))
    return grads


# The gradient checks are about the algorithm, not float32's rounding: the pipeline adds the
# micro-batches' contributions in another order than one graph does, with kernels and thread
# counts of its own, and BatchNorm's backward amplifies float32's rounding of that by up to
# ~2,000 eps of a gradient's scale (machine to machine: 1.5e-6 of conv1's scale here, 2.3e-4
# on another machine). So both sides compute in float64, where 1e6 eps (2.2e-10 of the scale)
# is a bound with a wide margin on any machine, and still far below any real error.
EXACT = torch.float64
TOLERANCE = 1e6 * torch.finfo(EXACT).eps


def assert_gradient_close(name: str, grad: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to TOLERANCE relative to the gradient's scale, elementwise and in norm."""
    assert grad.dtype == expected.dtype == EXACT, (name, grad.dtype, expected.dtype)
    scale = expected.abs().max().item()
    try:
        torch.testing.assert_close(grad, expected, rtol=TOLERANCE, atol=TOLERANCE * scale)
    except AssertionError as e:
        raise AssertionError(f"gradient of {name}: {e}") from None
    assert (grad - expected).norm() <= TOLERANCE * expected.norm(), name


def check_gradients(
    job: spec.Job, tmp_path, timeout: float = 150, schedules: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """One step of `job` through a real pipeline world against the same model, seed and
    micro-batches in one process: the same loss and gradients (with replicas, the averaged
    gradients of every replica's share against the whole batch's). BatchNorm normalises each
    micro-batch by its own statistics, so the reference runs them one at a time too. With
    `schedules` (the pipelining engine's, as PipelineSpec fields: schedule,
    stages_per_process), each runs in the same world and is checked; the last one's run is
    returned."""
    s = job.settings
    assert s.engine != "rpc" or s.replicas.max == 1, "the rpc engine's check: one pipeline"
    rpc_port, ddp_port = free_ports(2)
    processes = plan.plan_world(job, lambda m: LOOPBACK, plan.Ports(rpc_port, ddp_port))
    out = tmp_path / "pipeline.pt"
    if schedules:
        Path(f"{out}.schedules.json").write_text(json.dumps(schedules))
    runs = run_world(_gradient_world, [p.env for p in processes], out, timeout)
    assert len(runs) == len(schedules or [{}])

    default = torch.get_default_dtype()
    torch.set_default_dtype(EXACT)
    try:
        model = models.build(s)
        with data.Feed(s) as feed:
            inputs, labels = feed.batch()
    finally:
        torch.set_default_dtype(default)
    with cut.without_cache(model):  # as the pipeline runs a Hugging Face model
        outputs = join([model(x) for x in inputs.tensor_split(s.micro_batches * s.replicas.max)])
    loss = workloads.loss(s)(outputs, labels)
    loss.backward()

    # A parameter the forward never uses (the state no stage holds) has no gradient anywhere.
    params = {n: p for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    for got in runs:
        pieces = dataclasses.replace(s, **got["variant"]).pieces
        assert len(got["stages"]) == pieces and all(got["stages"]), got["variant"]
        assert got["loss"] == pytest.approx(loss.item(), rel=TOLERANCE), got["variant"]
        # Every name, a tied weight's too: each stage holding it got the pair's whole gradient;
        # the stages keep the model's names, and a frozen weight gets none there either.
        grads = {name: g for name, g in got["grads"].items() if g is not None}
        assert sorted(grads) == sorted(params), set(grads) ^ set(params)
        for name, p in params.items():
            assert_gradient_close(f"{name} ({got['variant']})", got["grads"][name], p.grad)
        # The forwards moved BatchNorm's statistics as one process's do, and nothing else did.
        held = got["rest"] | {k: v for state in got["states"] for k, v in state.items()}
        persistent = model.state_dict().keys()  # a non-persistent buffer is no stage's state
        for name, buffer in model.named_buffers():
            if name not in persistent:
                continue
            torch.testing.assert_close(
                held[name], buffer, rtol=TOLERANCE, atol=0, msg=f"{name} ({got['variant']})"
            )
    return runs[-1]


# ------------------------------------------------------------ checkpoints compared


def final_state(root: Path, steps: int) -> dict[str, Any]:
    found = checkpoint.latest(root)
    assert found is not None and found.step == steps, found
    return {entry["name"]: found.load(entry["name"]) for entry in found.manifest["files"]}


def by_parameter(state: dict[str, Any]) -> dict[str, Any]:
    """A pipeline's final state by parameter name, whichever stage holds it: each run measures
    its own layer costs, and two runs may cut the model in different places."""
    merged: dict[str, Any] = {"model": {}, "optimizers": {"optimizer": {}}}
    for name, part in state.items():
        if name.startswith("stage"):
            merged["model"] |= part["model"]
            merged["optimizers"]["optimizer"] |= part["optimizers"]["optimizer"]
    return {"stages": merged, "master.pt": state["master.pt"]}


def assert_states_close(got: dict[str, Any], expected: dict[str, Any]) -> None:
    """Model weights, BatchNorm statistics and optimizer state equal within float tolerance:
    micro-batches' gradient contributions add up in arrival order (each stage runs forwards,
    which update BatchNorm's statistics, in micro-batch order)."""
    assert sorted(got) == sorted(expected)
    for name in expected:
        if "model" not in expected[name]:
            continue
        assert sorted(got[name]["model"]) == sorted(expected[name]["model"])
        for key, value in expected[name]["model"].items():
            torch.testing.assert_close(
                got[name]["model"][key],
                value,
                rtol=1e-4,
                atol=1e-6,
                msg=lambda m, k=key, n=name: f"{n} {k}: {m}",
            )
        for owner, state in expected[name]["optimizers"].items():
            for param, tensors in state.items():
                for key, value in tensors.items():
                    torch.testing.assert_close(
                        got[name]["optimizers"][owner][param][key], value, rtol=1e-4, atol=1e-6
                    )


def assert_fits(value: dict[str, Any], shape: type) -> None:
    """`value` (JSON a run wrote or sent) has every key its TypedDict `shape` requires and
    none it does not declare: the type is the format."""
    keys = set(value)
    missing = shape.__required_keys__ - keys
    declared = shape.__required_keys__ | shape.__optional_keys__
    assert not missing and keys <= declared, (
        f"{shape.__name__}: missing {sorted(missing)}, undeclared {sorted(keys - declared)}"
    )
