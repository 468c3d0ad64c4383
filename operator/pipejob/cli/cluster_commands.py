"""The cluster side of the `pipejob` command: `operator`, `render` and `crds`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import yaml

from pipejob.core.validate import ALLOW_NODE_VOLUMES_ENV

LOG_LEVELS = ("debug", "info", "warning", "error")
METRICS_PORT = 8081  # next to the chart's health port 8080


def cmd_operator(args: argparse.Namespace) -> int:
    import kopf

    from pipejob.operator import controller, policy_settings

    try:  # a bad setting stops the operator before it handles any job
        policy_settings.from_env()
    except policy_settings.BadSettings as e:
        print(f"pipejob operator: {e}", file=sys.stderr)
        return 2
    if args.allow_node_volumes:  # the reconciles read it (core/validate.py)
        os.environ[ALLOW_NODE_VOLUMES_ENV] = "true"
    level = getattr(logging, args.log_level.upper())
    kopf.configure(debug=level <= logging.DEBUG, quiet=level >= logging.WARNING)
    logging.getLogger().setLevel(level)
    if level > logging.DEBUG:  # "Handler 'on_pod' succeeded" on every pod change says little
        logging.getLogger("kopf.objects").setLevel(max(level, logging.WARNING))
    health = f"http://{args.health_host}:{args.health_port}/healthz" if args.health_port else None
    try:
        controller.run(
            namespaces=args.namespaces or [],
            all_namespaces=args.all_namespaces,
            health=health,
            peering=args.peering,
            metrics=(args.metrics_host, args.metrics_port) if args.metrics_port else None,
        )
    except OSError as e:  # the metrics port is taken: say so, not a traceback
        print(f"pipejob operator: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from pipejob.core import spec
    from pipejob.operator import kube, policy_settings

    try:
        job = spec.load(args.file, args.allow_node_volumes, cluster=True)
        policy = policy_settings.from_env()
    except (spec.InvalidSpec, policy_settings.BadSettings) as e:
        print(f"pipejob: {e}", file=sys.stderr)
        return 2
    namespace = args.namespace or job.namespace or "default"
    objects = kube.render(job, namespace, args.image, policy)
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False, width=100))
    return 0


def cmd_crds(args: argparse.Namespace) -> int:
    from pipejob.operator import crd

    if args.output_dir:
        for path in crd.write(args.output_dir):
            print(f"wrote {path}")
    else:
        sys.stdout.write("---\n".join(crd.generated().values()))
    return 0


def allow_node_volumes(parser: argparse.ArgumentParser) -> None:
    """The flag that lets hostPath and other node-level volumes through (the operator's
    allowance, for checking a manifest the way an operator that allows them would)."""
    parser.add_argument(
        "--allow-node-volumes",
        action="store_true",
        help="accept hostPath, gitRepo and flexVolume volumes (refused by default)",
    )


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """`operator`, `render` and `crds`, each with its flags."""
    _add_operator(sub)
    _add_render(sub)
    crds = sub.add_parser(
        "crds",
        help="print the CustomResourceDefinitions (or write them with --output-dir)",
    )
    crds.add_argument("-o", "--output-dir", metavar="DIR", help="write one file per CRD here")
    crds.set_defaults(func=cmd_crds)


OPERATOR_DESCRIPTION = (
    "Run the pipejob operator: it watches PipelineJobs and HybridJobs and "
    "makes, tracks, restarts and cleans up their pods. Credentials come from the "
    "in-cluster service account or the kubeconfig ($KUBECONFIG). The default trainer "
    "image is $PIPEJOB_TRAINER_IMAGE; $PIPEJOB_NETWORK_POLICY sets the NetworkPolicy of each "
    "job's world (unset: its pods admit only each other; off: none; or JSON, as the chart "
    "writes it); $PIPEJOB_RESYNC_SECONDS sets how often every job "
    "is looked at again (default 10); $PIPEJOB_PROGRESS_SECONDS how often the progress of "
    "a running job is read from its master's monitor port (default 3; 0: never)."
)


def _add_operator(sub: argparse._SubParsersAction) -> None:
    op = sub.add_parser(
        "operator",
        help="run the Kubernetes operator (kubeconfig or in-cluster service account)",
        description=OPERATOR_DESCRIPTION,
    )
    where = op.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "-n",
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="NAMESPACE",
        help="serve this namespace (repeatable)",
    )
    where.add_argument("-A", "--all-namespaces", action="store_true", help="serve all namespaces")
    _add_endpoints(op)
    op.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="default info")
    op.add_argument(
        "--allow-node-volumes",
        action="store_true",
        help="let jobs use hostPath, gitRepo and flexVolume volumes, which reach into the node"
        f" (refused by default, as Pod Security baseline does; also ${ALLOW_NODE_VOLUMES_ENV})",
    )
    peers = op.add_mutually_exclusive_group()
    peers.add_argument(
        "--standalone",
        dest="peering",
        action="store_const",
        const=None,
        help="run as the only operator, without kopf peering (the default)",
    )
    peers.add_argument(
        "--peering",
        metavar="NAME",
        help="join the kopf peering object NAME: of several replicas only one is active",
    )
    op.set_defaults(func=cmd_operator)


def _add_endpoints(op: argparse.ArgumentParser) -> None:
    """The operator's liveness and metrics endpoints."""
    op.add_argument(
        "--health-port",
        type=int,
        metavar="PORT",
        help="serve the liveness endpoint /healthz on this port",
    )
    op.add_argument(
        "--health-host",
        default="0.0.0.0",
        metavar="ADDRESS",
        help="address of the liveness endpoint (default 0.0.0.0)",
    )
    op.add_argument(
        "--metrics-port",
        type=int,
        default=METRICS_PORT,
        metavar="PORT",
        help=f"serve Prometheus metrics on /metrics at this port (default {METRICS_PORT}; 0: off)",
    )
    op.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        metavar="ADDRESS",
        help="address of the metrics endpoint (default 0.0.0.0)",
    )


def _add_render(sub: argparse._SubParsersAction) -> None:
    render = sub.add_parser(
        "render",
        help="print the Service, NetworkPolicy and Pods the operator would create for a manifest",
        description="Print, as multi-document YAML, the headless Service, the world's "
        "NetworkPolicy (as $PIPEJOB_NETWORK_POLICY sets it, as for the operator), the PodGroup "
        "of a gang-scheduled job and the Pods the operator creates for a job (for review, or "
        "`kubectl apply --dry-run=client -f -`).",
    )
    render.add_argument("file", help="PipelineJob or HybridJob manifest (YAML)")
    render.add_argument(
        "-n",
        "--namespace",
        help="namespace of the objects (default: the manifest's, else default)",
    )
    render.add_argument("--image", help="trainer image (default: $PIPEJOB_TRAINER_IMAGE)")
    allow_node_volumes(render)
    render.set_defaults(func=cmd_render)
