"""The schema fuzzer (tests/fuzz_spec.py) in the suite, bounded: every field of both kinds
mutated at least once, a few hundred random manifests of one to three mutations, and a
handful through the real `pipejob` command (exit 2, one line per error, no traceback).
`python tests/fuzz_spec.py --examples 20000 --sweep` runs as many as asked; so does
PIPEJOB_FUZZ_EXAMPLES here."""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
from pathlib import Path

import fuzz_spec
import pytest
import yaml

PIPEJOB = Path(sys.executable).parent / "pipejob"
EXAMPLES = int(os.environ.get("PIPEJOB_FUZZ_EXAMPLES", "200"))

pytestmark = pytest.mark.timeout(240)


def test_every_field_is_refused_in_one_line_or_runs():
    count, failures = fuzz_spec.sweep(seed=0, per_field=1)
    fields = sum(len(paths) for paths in fuzz_spec.table_paths().values())
    assert count >= 2 * fields  # each field on two seeds, and moved or duplicated where it can
    assert not failures, "\n".join(failures[:20])


def test_random_manifests_are_refused_in_one_line_or_run():
    failures = fuzz_spec.run(EXAMPLES, seed=43)
    assert not failures, "\n".join(failures[:20])


def refused_and_accepted(seed: int) -> tuple[list[dict], dict]:
    """Two mutated manifests the validation refuses (one per kind), and one it accepts."""
    rng, starts, paths = random.Random(seed), fuzz_spec.seeds(), fuzz_spec.table_paths()
    refused: dict[str, dict] = {}
    accepted = None
    while len(refused) < 2 or accepted is None:
        manifest, _ = fuzz_spec.mutated(rng, starts, paths)
        if fuzz_spec.renders(manifest):
            accepted = accepted or manifest
        else:
            refused.setdefault(manifest["kind"], manifest)
    return list(refused.values()), accepted


def pipejob(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(PIPEJOB), *args], capture_output=True, text=True, timeout=60)


def test_the_command_refuses_in_one_line_per_error_with_exit_2(tmp_path: Path):
    refused, accepted = refused_and_accepted(seed=43)
    files = []
    for i, manifest in enumerate([*refused, accepted]):
        files.append(tmp_path / f"job{i}.yaml")
        files[-1].write_text(yaml.safe_dump(copy.deepcopy(manifest)))
    done = pipejob("validate", *map(str, files))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{files[-1]}: valid {accepted['kind']}" in done.stdout
    for path in files[:-1]:
        for verb in ("plan", "render"):
            done = pipejob(verb, str(path))
            assert (done.returncode, done.stdout) == (2, ""), (verb, done.stderr)
            header, *errors = done.stderr.splitlines()
            assert header == f"pipejob: {path}: invalid job:"
            assert errors and all(e.startswith("  spec") and len(e) < 420 for e in errors), errors
    for verb in ("plan", "render"):
        assert pipejob(verb, str(files[-1])).returncode == 0, verb
