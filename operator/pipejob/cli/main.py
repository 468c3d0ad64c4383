"""The `pipejob` command."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from pipejob.cli import cluster_commands
from pipejob.core import spec
from pipejob.core.plan import plan_world
from pipejob.operator import kube


def _load_or_exit(path: str, allow_node_volumes: bool = False) -> spec.Job:
    try:
        return spec.load(path, allow_node_volumes)
    except spec.InvalidSpec as e:
        print(f"pipejob: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_run(args: argparse.Namespace) -> int:
    from pipejob.runner.local import run_job

    job = _load_or_exit(args.file, args.allow_node_volumes)
    if args.size is not None:
        job = _at_size(job, args.size)
    # The manifest's folder holds the user's code and is where its relative paths start.
    return run_job(job, grace=args.grace, directory=Path(args.file).resolve().parent)


def _at_size(job: spec.Job, size: int) -> spec.Job:
    """The job with its world at `size` (of its elastic replicas or trainers), or exit 2."""
    if job.definition.elastic is None:
        print(f"pipejob: --size: a {job.kind} has no size to choose", file=sys.stderr)
        raise SystemExit(2)
    try:
        job = job.sized(size)
        job.shape  # noqa: B018 (refuses a size outside the job's range)
    except ValueError as e:
        print(f"pipejob: --size: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return job


# The module behind `pipejob export`: the trainer's, so it is imported only when asked for.
EXPORT_MODULE = "pipejob.trainer.export"


def _trainer_missing(module: str | None) -> bool:
    """Is `module` (an ImportError's) the trainer or one of its own dependencies?"""
    top = (module or "").split(".")[0]
    return top in ("torch", "torchvision", "safetensors", "numpy") or (module or "") in (
        "pipejob.trainer",
        EXPORT_MODULE,
    )


def cmd_export(args: argparse.Namespace) -> int:
    try:
        export = importlib.import_module(EXPORT_MODULE)
    except ImportError as e:
        if not _trainer_missing(e.name):  # a bug in an installed trainer: show it
            raise
        print(
            f"pipejob: export needs the trainer ({EXPORT_MODULE} and torch), which is not"
            f" installed here ({e}); install pipejob with its trainer extra, or run"
            " `pipejob export` in the trainer image",
            file=sys.stderr,
        )
        return 2
    return int(export.main(args.checkpoint_dir, args.out, args.format))


def cmd_validate(args: argparse.Namespace) -> int:
    failed = False
    for path in args.files:
        try:
            job = spec.load(path, args.allow_node_volumes)
        except spec.InvalidSpec as e:
            print(f"pipejob: {e}", file=sys.stderr)
            failed = True
        else:
            print(f"{path}: valid {job.kind} {job.name!r}")
    return 2 if failed else 0


def cmd_plan(args: argparse.Namespace) -> int:
    job = _load_or_exit(args.file, args.allow_node_volumes)
    print(f"{'rank':>4}  {'rpc name':<10} {'role':<8} {'gpus':>4}  {'ddp':<5} address")
    for p in plan_world(job, kube.addresser(job)):
        ddp = f"{p.seat.rank}/{p.seat.size}" if p.seat is not None else "-"
        print(f"{p.rank:>4}  {p.rpc_name:<10} {p.role:<8} {p.gpus:>4}  {ddp:<5} {p.address}")
    for line in job.definition.describe(job.settings):
        print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipejob",
        description="Run PyTorch RPC pipeline-parallel and hybrid DDP+RPC jobs, "
        "locally or on Kubernetes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a job manifest as local processes")
    run.add_argument("file", help="PipelineJob or HybridJob manifest (YAML)")
    run.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds a process gets to exit after SIGTERM before SIGKILL (default 10)",
    )
    run.add_argument(
        "--size",
        type=int,
        help="the world's size: its replicas (PipelineJob) or trainers (HybridJob), within"
        " the spec's {min, max} (default: max), as the operator would run it where only that"
        " many fit",
    )
    cluster_commands.allow_node_volumes(run)
    run.set_defaults(func=cmd_run)

    validate = sub.add_parser("validate", help="check manifests; print every error")
    validate.add_argument("files", nargs="+", metavar="FILE")
    cluster_commands.allow_node_volumes(validate)
    validate.set_defaults(func=cmd_validate)

    plan = sub.add_parser("plan", help="print the world plan: ranks, roles, addresses, tables")
    plan.add_argument("file")
    cluster_commands.allow_node_volumes(plan)
    plan.set_defaults(func=cmd_plan)

    export = sub.add_parser(
        "export",
        help="write one model file (and its JSON) from a complete checkpoint: the newest"
        " under CHECKPOINT_DIR, or that step directory",
    )
    export.add_argument(
        "checkpoint_dir",
        metavar="CHECKPOINT_DIR",
        help="a job's checkpoint.path, or one step directory under it",
    )
    export.add_argument("out", metavar="OUT", help="directory the model files and their JSON go in")
    export.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        default="safetensors",
        help="file format (default safetensors)",
    )
    export.set_defaults(func=cmd_export)

    cluster_commands.add_subcommands(sub)  # operator, render, crds
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
