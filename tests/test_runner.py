"""`pipejob run`: real trainer processes on loopback, stopped together when one fails."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobrun import STARTED, JobRun, pipeline_job

PIPEJOB = [sys.executable, "-m", "pipejob.cli"]

LONG_PIPELINE = pipeline_job("long", stages=2, microBatches=2, batchSize=4, steps=100000)


def pids(run: JobRun) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in STARTED.finditer(run.output)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"  # a zombie is gone


@pytest.mark.timeout(240)
def test_killed_stage_stops_the_world(tmp_path):
    with JobRun(LONG_PIPELINE, tmp_path) as run:
        run.wait_for(r"^master\s*\|.*step 2/", timeout=180)
        started = pids(run)
        assert set(started) == {"master", "stage0", "stage1"}
        os.kill(started["stage1"], signal.SIGKILL)
        code = run.finish(timeout=60)
    assert code != 0
    assert "stage1 (role stage, rank 2) failed: killed by signal SIGKILL" in run.output
    assert not [name for name, pid in started.items() if alive(pid)], run.output


@pytest.mark.timeout(240)
def test_interrupting_the_runner_stops_every_process(tmp_path):
    with JobRun(LONG_PIPELINE, tmp_path) as run:
        run.wait_for(r"^master\s*\|.*step 1/", timeout=180)
        started = pids(run)
        run.popen.send_signal(signal.SIGTERM)
        code = run.finish(timeout=60)
    assert code == 130
    assert not [name for name, pid in started.items() if alive(pid)]


def listening(pid: int) -> set[str]:
    """The addresses a process's TCP sockets listen on (from /proc: its sockets' inodes)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                # /proc writes each 32-bit word of the address in host (little-endian) order.
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                address = ipaddress.ip_address(words)
                found.add(str(getattr(address, "ipv4_mapped", None) or address))
    return found


HYBRID = {
    "apiVersion": "pipejob.dev/v1alpha1",
    "kind": "HybridJob",
    "metadata": {"name": "shared"},
    "spec": {
        "trainers": 2,
        "embedding": {"numEmbeddings": 64, "dim": 8},
        "dense": {"outFeatures": 4},
        "steps": 100000,
        "batchSize": 8,
        "bagSize": 4,
        "datasetSize": 2000000,
        "rendezvousTimeoutSeconds": 60,
    },
}


@pytest.mark.timeout(240)
def test_a_local_world_listens_on_loopback_only(tmp_path):
    """Every member of a `pipejob run` world (RPC, the rendezvous stores, the DDP group, the
    master's monitor) listens on loopback alone: the machine's network reaches none of them."""
    with JobRun(HYBRID, tmp_path) as run:
        run.wait_for(r"^master\s*\|.*step \d+/", timeout=180)
        heard = {name: listening(pid) for name, pid in pids(run).items()}
        run.popen.send_signal(signal.SIGTERM)
        run.finish(timeout=60)
    assert set(heard) == {"master", "ps0", "trainer0", "trainer1"}
    assert heard["master"] and heard["trainer0"], heard  # the stores, the monitor, RPC
    wider = {
        n: a for n, a in heard.items() if not all(ipaddress.ip_address(x).is_loopback for x in a)
    }
    assert not wider, f"listening beyond loopback: {wider}"


@pytest.mark.timeout(60)
def test_bad_manifest_starts_nothing(tmp_path):
    bad = dict(LONG_PIPELINE, spec={**LONG_PIPELINE["spec"], "stages": 1, "batchSize": 3})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = subprocess.run(
        [*PIPEJOB, "run", str(path)], capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 2
    assert "spec.stages: must be >= 2, got 1" in result.stderr
    assert "started" not in result.stdout + result.stderr


# A stand-in trainer: what a process sees of the manifest's folder (the boundary here is the
# runner's process setup, not training).
SHOW_SETUP = (
    "import os, sys\n"
    "import userpkg\n"  # beside the manifest, importable only through PYTHONPATH
    "print('role', os.environ['PIPEJOB_RPC_NAME'], 'cwd', os.getcwd(), 'found', userpkg.WHERE,"
    " 'path', os.environ['PYTHONPATH'], 'data', open('data/train.txt').read().strip())\n"
)


@pytest.mark.timeout(60)
def test_run_imports_and_resolves_paths_from_the_manifest_folder(tmp_path, monkeypatch, capfd):
    import pipejob.runner.local as local
    from pipejob.cli import main as cli

    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "userpkg.py").write_text("WHERE = 'beside the manifest'\n")
    (folder / "data" / "train.txt").write_text("relative to the manifest\n")
    manifest = pipeline_job("here", stages=2, output={"path": "out"})
    (folder / "job.yaml").write_text(yaml.safe_dump(manifest))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the user runs it from another folder
    monkeypatch.setenv("PYTHONPATH", "/opt/theirs")  # and keeps their own path
    monkeypatch.setattr(local, "TRAINER_MODULE", ("-c", SHOW_SETUP))

    relative = os.path.relpath(folder / "job.yaml")  # ../project/job.yaml
    assert cli.main(["run", "--grace", "5", relative]) == 0
    out = capfd.readouterr().out
    lines = [line for line in out.splitlines() if "| role " in line]
    assert len(lines) == 3, out  # master, stage0, stage1
    want = (
        f"cwd {folder} found beside the manifest path {folder}{os.pathsep}/opt/theirs"
        " data relative to the manifest"
    )
    assert all(line.endswith(want) for line in lines), out


def test_the_manifest_folder_goes_first_on_the_callers_python_path():
    from pipejob.runner.local import python_path

    assert python_path(Path("/m"), None) == "/m"
    assert python_path(Path("/m"), "/a:/b") == f"/m{os.pathsep}/a:/b"


# --- pipejob export: the CLI's side (the trainer's module does the work) ----------------------


def test_export_calls_the_trainers_module_only_when_invoked(monkeypatch, tmp_path):
    import types

    from pipejob.cli import main as cli

    calls = []
    fake = types.ModuleType("pipejob.trainer.export")
    fake.main = lambda checkpoint_dir, out, format: calls.append((checkpoint_dir, out, format)) or 0
    monkeypatch.setitem(sys.modules, "pipejob.trainer.export", fake)
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "model")]) == 0
    assert cli.main(["export", "ckpt/step-10", "out", "--format", "torch"]) == 0
    assert calls == [
        (str(tmp_path / "ckpt"), str(tmp_path / "model"), "safetensors"),
        ("ckpt/step-10", "out", "torch"),
    ]
    fake.main = lambda checkpoint_dir, out, format: 1  # the export's own failure is the code
    assert cli.main(["export", "ckpt", "out"]) == 1


def test_export_without_the_trainer_says_what_is_missing(monkeypatch, capsys):
    from pipejob.cli import main as cli

    monkeypatch.setitem(sys.modules, "pipejob.trainer.export", None)  # as if not installed
    assert cli.main(["export", "ckpt", "out"]) == 2
    err = capsys.readouterr().err
    assert "export needs the trainer" in err and "trainer extra" in err
    with pytest.raises(SystemExit):
        cli.main(["export", "ckpt", "out", "--format", "pickle"])  # not a format


@pytest.mark.timeout(60)
def test_the_cli_imports_no_torch_until_export_runs():
    code = (
        "import sys; from pipejob.cli import main; main.build_parser();"
        " assert 'torch' not in sys.modules and 'pipejob.trainer' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr


def test_free_ports_are_below_the_range_outgoing_connections_take_theirs_from():
    """A port the kernel hands out is one an outgoing connection of another world could
    take before this world's master binds it (a suite on 2 workers once lost a world so:
    "Address already in use"); pipejob's are drawn below that range, distinct and free."""
    import socket

    from pipejob.runner.local import LOOPBACK, free_ports

    start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(8)
    assert len(set(ports)) == 8, ports
    assert all(start // 2 <= p < start for p in ports), (ports, start)
    for port in ports:
        with socket.socket() as s:
            s.bind((LOOPBACK, port))
