"""Job-level helpers for the operator tests: make jobs, read them and their pods, wait."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from harness.client import Api
from pipejob.core.kinds import KINDS
from pipejob.core.spec import API_VERSION
from pipejob.operator.kube import JOB_LABEL, RESTART_LABEL

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CRD_RESOURCE = "apiextensions.k8s.io/v1/customresourcedefinitions"
FINISHED = ("Succeeded", "Failed")


def resource(kind: str) -> str:
    return f"{API_VERSION}/{KINDS[kind].plural}"


def apply_crd(api: Api, crd: dict) -> dict:
    return api.create(CRD_RESOURCE, crd)


def example(file: str, **spec: Any) -> dict:
    """An example manifest with some spec fields overridden (smaller, for speed)."""
    manifest = yaml.safe_load((EXAMPLES / file).read_text())
    manifest["spec"] = {**manifest.get("spec", {}), **copy.deepcopy(spec)}
    return manifest


def create(api: Api, manifest: dict, namespace: str = "default") -> dict:
    return api.create(resource(manifest["kind"]), manifest, namespace)


def get(api: Api, kind: str, name: str, namespace: str = "default") -> dict | None:
    return api.find(resource(kind), name, namespace)


def pods(api: Api, job: str, namespace: str = "default") -> list[dict]:
    return api.list("v1/pods", namespace, labelSelector=f"{JOB_LABEL}={job}")


def wait_pods(
    api: Api,
    job: str,
    names_: list[str],
    timeout: float,
    restart: int | None = None,
    namespace: str = "default",
) -> list[dict]:
    """The job's pods (of that restart) once they are exactly `names_`."""

    def check() -> list[dict] | None:
        found = pods(api, job, namespace)
        if restart is not None:
            found = [p for p in found if p["metadata"]["labels"].get(RESTART_LABEL) == str(restart)]
        return found if names(found) == sorted(names_) else None

    return api.wait(f"pods {', '.join(names_)}", check, timeout)


def env(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])}


def names(objects: list[dict]) -> list[str]:
    return sorted(o["metadata"]["name"] for o in objects)


def wait_phase(
    api: Api,
    kind: str,
    name: str,
    phases: str | tuple[str, ...],
    timeout: float,
    namespace: str = "default",
) -> dict:
    """The job once its status.phase is one of `phases`; fails early on an unexpected finish."""
    phases = (phases,) if isinstance(phases, str) else phases

    def check() -> dict | None:
        job = get(api, kind, name, namespace) or {}
        phase = job.get("status", {}).get("phase")
        if phase in FINISHED and phase not in phases:
            raise AssertionError(f"{kind} {name} finished {phase}, not {phases}: {job['status']}")
        return job if phase in phases else None

    return api.wait(f"{kind} {name} to be {' or '.join(phases)}", check, timeout)


def warnings(api: Api, namespace: str = "default") -> list[str]:
    """The Warning events' messages: why each restart happened, for an assertion to show."""
    return [e["message"] for e in api.list("v1/events", namespace) if e["type"] == "Warning"]
