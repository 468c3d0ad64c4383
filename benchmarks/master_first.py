"""What the operator's master-first order (operator/master_check.py) costs a healthy job: the
seconds from a PipelineJob's creation to its stage pods, its master's step 1 and Succeeded, on the
tests' emulated cluster (API server, a process kubelet, the unmodified `pipejob operator`),
with the order (`first`) and without it (`together`: every pod at once, as before it; the
same operator with core/master_first.on_cluster answering False). Runs alternate between
the two; the operator polls /progress every --progress seconds (3, its default). Prints.

    python benchmarks/master_first.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import yaml  # noqa: E402

from harness import jobs, operator_process  # noqa: E402  (the tests' harness)
from harness.cluster import Cluster  # noqa: E402
from harness.kubelet import Kubelet  # noqa: E402
from harness.operator_process import OperatorProcess  # noqa: E402

# `pipejob operator` with the order switched off: every pod of a world at once, no
# PIPEJOB_MASTER_FIRST (the operator before master_check.py).
TOGETHER = """#!{python}
import sys
from pipejob.core import master_first
master_first.on_cluster = lambda job: False
from pipejob.cli.main import main
sys.exit(main())
"""


def manifest(name: str, tokens: Path) -> dict:
    env = [{"name": "PYTHONPATH", "value": str(REPO / "tests")}]  # userpkg
    return {
        "apiVersion": "pipejob.dev/v1alpha1",
        "kind": "PipelineJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"import": "userpkg.gpt_forwards:nanogpt"},
            "loss": {"import": "userpkg.traced_cases:gpt_loss"},
            "data": {"tokens": {"train": str(tokens), "seqLen": 16}},
            "eval": {"everySteps": 0},
            "stages": 2,
            "microBatches": 2,
            "batchSize": 8,
            "steps": 4,
            "logEvery": 1,
            "template": {"env": env},
        },
    }


def one_run(order: str, work: Path, progress: float) -> tuple[float, float, float]:
    """Seconds from the job's creation to its first stage pod seen, its master's step 1 (in
    its log) and Succeeded, each polled every 0.1 s."""
    tokens = work / "tokens.bin"
    tokens.write_bytes(b"".join((i % 64).to_bytes(2, "little") for i in range(4096)))
    if order == "together":
        wrapper = work / "pipejob-together"
        wrapper.write_text(TOGETHER.format(python=sys.executable))
        wrapper.chmod(0o755)
        operator_process.PIPEJOB = wrapper
    else:
        operator_process.PIPEJOB = Path(sys.executable).parent / "pipejob"
    with Cluster(work / "cluster") as cluster, Kubelet(cluster.api, work / "node") as node:
        for path in sorted((REPO / "crds").glob("*.yaml")):
            jobs.apply_crd(cluster.api, yaml.safe_load(path.read_text()))
        node.network.forward(cluster.port)
        op = OperatorProcess(
            cluster.kubeconfig,
            cluster.namespace,
            work / "operator.log",
            network=node.network,
            progress_seconds=progress,
            args=("--allow-node-volumes",),
        )
        op.start()
        try:
            began = time.monotonic()
            jobs.create(cluster.api, manifest("gpt", tokens))
            step1 = stages = None
            api = cluster.api
            while time.monotonic() - began < 600:
                if step1 is None and "step 1/" in node.logs(cluster.namespace, "gpt-master-0"):
                    step1 = time.monotonic() - began
                status = (jobs.get(cluster.api, "PipelineJob", "gpt") or {}).get("status") or {}
                if stages is None and any("stage" in n for n in jobs.names(jobs.pods(api, "gpt"))):
                    stages = time.monotonic() - began
                if status.get("phase") in ("Succeeded", "Failed"):
                    if status["phase"] == "Failed":
                        raise RuntimeError(f"{order}: the job failed: {status}")
                    return stages or float("nan"), step1 or float("nan"), time.monotonic() - began
                time.sleep(0.1)
            raise RuntimeError(f"{order}: not finished within 600 s")
        finally:
            op.stop()


def said(figures: tuple[float, ...]) -> str:
    stages, step1, done = figures
    return f"stage pods after {stages:5.1f} s, step 1 after {step1:5.1f} s, Succeeded {done:5.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--progress", type=float, default=3.0, help="the operator's poll, s")
    args = parser.parse_args()
    times: dict[str, list[tuple[float, float, float]]] = {"first": [], "together": []}
    for i in range(args.repeats):
        for order in ("first", "together") if i % 2 == 0 else ("together", "first"):
            with tempfile.TemporaryDirectory(prefix="master-first-") as work:
                times[order].append(one_run(order, Path(work), args.progress))
            print(f"run {i + 1} {order:8}: " + said(times[order][-1]))
    for order, runs in times.items():
        medians = tuple(statistics.median(r[k] for r in runs) for k in range(3))
        print(f"{order:8} median of {len(runs)}: " + said(medians))


if __name__ == "__main__":
    main()
