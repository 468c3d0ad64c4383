"""What ships is what is tested: both images, built from this checkout by `scripts/images.sh`
(as `make images` builds them), start, hold exactly this checkout's code, and keep to their
side of the torch line. An image whose installed files differ from the checkout (once, stale
empty copies from setuptools' build/ folder shipped in place of the code) fails here."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from harness.docker import Images

# The timeout bounds each test; the images fixture bounds its own build (scripts/images.sh).
pytestmark = pytest.mark.timeout(120, func_only=True)

ROOT = Path(__file__).resolve().parents[1]
OPERATOR_CODE = ROOT / "operator" / "pipejob"
TRAINER_CODE = ROOT / "trainer" / "pipejob" / "trainer"

# Run inside an image: the sha256 of every .py file of the installed pipejob package.
INSTALLED = """
import hashlib, json, pathlib, pipejob
root = pathlib.Path(pipejob.__file__).parent
print(json.dumps({str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                  for p in sorted(root.rglob("*.py"))}))
"""


def run(image: str, *args: str, entrypoint: str | None = None) -> subprocess.CompletedProcess:
    argv = ["docker", "run", "--rm", "--network", "none"]
    argv += ["--entrypoint", entrypoint] if entrypoint else []
    return subprocess.run([*argv, image, *args], capture_output=True, text=True, timeout=120)


def installed(image: str) -> dict[str, str]:
    done = run(image, "-c", INSTALLED, entrypoint="python")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def checkout(folder: Path, prefix: str = "") -> dict[str, str]:
    return {
        prefix + str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def test_the_operator_image_starts_and_holds_the_checkouts_operator_code(images: Images):
    done = run(images.operator, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: pipejob operator" in done.stdout
    files = installed(images.operator)
    expected = checkout(OPERATOR_CODE)
    assert {k: v for k, v in files.items() if not k.startswith("trainer/")} == expected
    # The trainer's packages, which pyproject.toml lists, are there only as empty files.
    empty = hashlib.sha256(b"").hexdigest()
    trainer = {k: v for k, v in files.items() if k.startswith("trainer/")}
    assert trainer and set(trainer.values()) == {empty}, trainer


def test_the_trainer_image_holds_the_checkouts_code_and_starts_the_trainer(images: Images):
    assert installed(images.trainer) == checkout(OPERATOR_CODE) | checkout(TRAINER_CODE, "trainer/")
    # The entry point runs pipejob.trainer, which refuses an empty env as the contract says.
    done = run(images.trainer)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "permanent: BadEnvironment:" in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("which", "absent", "present"),
    [("operator", "torch", "kopf"), ("trainer", "kopf", "torch")],
)
def test_each_image_keeps_to_its_side_of_the_torch_line(images: Images, which, absent, present):
    image = getattr(images, which)
    check = (
        f"import importlib.util as u; "
        f"print(u.find_spec('{absent}'), u.find_spec('{present}') is not None)"
    )
    done = run(image, "-c", check, entrypoint="python")
    assert done.stdout.split() == ["None", "True"], done.stdout + done.stderr


@pytest.mark.parametrize("which", ["operator", "trainer"])
def test_each_image_runs_as_the_numeric_non_root_user(images: Images, which):
    done = run(getattr(images, which), "-u", entrypoint="id")
    assert done.stdout.strip() == "10001"
    print(f"{which} image {getattr(images, which)}: {images.size_mb(getattr(images, which))} MB")
