"""The static-check tools (scripts/install-tools.sh) as the tests use them: find a tool, run
it, render the chart. Under CI=true a missing tool fails the test; elsewhere it skips."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "pipejob"
TOOLS = Path(os.environ.get("PIPEJOB_TOOLS") or Path.home() / ".cache" / "pipejob" / "tools")
TOOLS_PYTHON = TOOLS / "venv" / "bin" / "python"  # has kubernetes-validate, jsonschema, cel
RELEASE = "pipejob"
NAMESPACE = "pipejob-system"

# Every address but loopback is unreachable for the tools (checkov would like to download).
OFFLINE = {
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "http_proxy": "http://127.0.0.1:9",
    "https_proxy": "http://127.0.0.1:9",
    "NO_PROXY": "",
    "no_proxy": "",
}


def missing(what: str) -> None:
    message = f"{what} is not installed: run scripts/install-tools.sh"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def tool(name: str) -> str:
    """Path of a tool: $PIPEJOB_TOOLS/bin first, then PATH."""
    path = TOOLS / "bin" / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        missing(name)
    return found


def tools_python() -> str:
    if not TOOLS_PYTHON.exists():
        missing(f"the tools venv ({TOOLS_PYTHON})")
    return str(TOOLS_PYTHON)


def run(
    cmd: list[str], timeout: float = 120, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `cmd` offline, with `env` added to the environment."""
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **OFFLINE, **(env or {})},
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def helm_template(values: dict[str, Any] | None, tmp: Path, crds: bool = False) -> str:
    """`helm template` of the chart with `values` (None: the defaults), as text."""
    cmd = [tool("helm"), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if crds:
        cmd.append("--include-crds")
    if values is not None:
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        cmd += ["--values", str(path)]
    return run(cmd).stdout


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]
