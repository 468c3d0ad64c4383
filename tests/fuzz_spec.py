"""A seeded schema fuzzer (issue 43): from valid manifests of both kinds (the examples, and
one per kind with every section written), it mutates the fields the spec tables name (so
the CRD schemas, generated from them, and docs/api-reference.md): a wrong type, an empty
string, list or map, zero, negative, huge, NaN and infinite numbers, an unknown enum member
and its case variants, a field moved a level up or down, a duplicate in a list of named
things; one to three at a time. For each manifest, `pipejob validate`, `plan` and `render`
(the functions the CLI calls, in process) must either refuse it, every error one line
naming a mutated field, or accept it; and then the rendered world's own checks accept it
too: every role's trainer reads its pod's env (the spec included) and builds its
optimizers, as a process does at start, with no world started.

    python tests/fuzz_spec.py --examples 20000 [--seed 0] [--sweep]

prints each failure (the manifest's mutations and what went wrong) and exits 1 if any;
--sweep first tries every field with each of its candidate values. tests/test_fuzz.py runs
a bounded number of both in the suite. Over 400 lines because the seeds, the mutations and
the checks are one program that runs on its own."""

from __future__ import annotations

import argparse
import copy
import math
import random
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipejob.core import spec
from pipejob.core.kinds import KINDS
from pipejob.core.plan import plan_world
from pipejob.core.schema import Field
from pipejob.operator import kube

ROOT = Path(__file__).resolve().parents[1]
# An error line longer than this is a wall of text, not a reason (issue 43: 400+ characters).
MAX_LINE = 400
Path_ = tuple[str | int, ...]

CKPT = {"path": "/ckpt", "everySteps": 5, "volume": "ckpt"}
TEMPLATE = {
    "image": "trainer:1",
    "imagePullPolicy": "IfNotPresent",
    "resources": {"limits": {"memory": "64Gi", "cpu": "4"}},
    "nodeSelector": {"pool": "cpu"},
    "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
    "volumes": [{"name": "ckpt", "emptyDir": {}}, {"name": "data", "emptyDir": {}}],
    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    "env": [{"name": "A", "value": "1"}],
    "serviceAccountName": "sa",
}
COMMON = {
    "steps": 20,
    "seed": 1,
    "deterministic": True,
    "logEvery": 2,
    "rendezvousTimeoutSeconds": 60,
    "optimizer": {
        "name": "sgd",
        "lr": 0.1,
        "momentum": 0.9,
        "weightDecay": 0.001,
        "clipGradNorm": 1.0,
        "schedule": {"warmupSteps": 2, "decay": "cosine", "minLr": 0.001},
    },
    "eval": {"everySteps": 5, "batches": 2},
    "output": {"path": "/out", "format": "torch"},
    "logging": {"tensorboard": "/tb"},
    "backoffLimit": 2,
    "activeDeadlineSeconds": 3600,
    "ttlSecondsAfterFinished": 60,
    "suspend": False,
    "template": TEMPLATE,
    "checkpoint": CKPT,
    "profile": {"steps": [2, 3], "path": "/prof", "rowLimit": 5},
    "preflight": {"enabled": True, "timeoutSeconds": 30, "megabytes": 1.0},
    "watchdog": {"seconds": 60},
    "elastic": {"pendingSeconds": 60},
    "oom": {"increase": 1.5, "maxMemory": "96Gi"},
    "scheduling": {
        "provider": "volcano",
        "queue": "q",
        "priorityClassName": "p",
        "schedulerName": "volcano",
    },
}
FULL = {
    "PipelineJob": {
        "model": {
            "transformer": {"vocabSize": 64, "layers": 4, "width": 32, "heads": 2, "seqLen": 16},
            "cut": "traced",
        },
        "stages": 2,
        "splitPoints": ["blocks.2"],
        "engine": "pipelining",
        "schedule": "1f1b",
        "stagesPerProcess": 1,
        "replicas": {"min": 1, "max": 2},
        "microBatches": 2,
        "batchSize": 8,
        "imageSize": 32,
        "numClasses": 10,
        "gpusPerStage": 0,
        "gradientAccumulation": 2,
        "precision": "bf16",
        "skipNonFiniteSteps": 1,
        "activationCheckpointing": True,
        "ema": {"decay": 0.99, "everySteps": 2, "warmup": 3, "output": "both"},
        "data": {
            "tokens": {"train": "/data/t.bin", "val": "/data/v.bin", "dtype": "uint16"},
            "workers": 1,
        },
        # The built-in loss's options (examples/custom-model has import and args).
        "loss": {"crossEntropy": {"labelSmoothing": 0.1, "ignoreIndex": -1}},
        **COMMON,
    },
    "HybridJob": {
        "trainers": {"min": 1, "max": 2},
        "parameterServers": 2,
        "embeddings": [
            {"name": "C1", "rows": 100, "dim": 8, "mode": "mean"},
            {"name": "C2", "rows": 50, "dim": 8, "feature": "C2"},
        ],
        "sparseOptimizer": {
            "name": "adam",
            "lr": 0.01,
            "eps": 1e-8,
            "beta1": 0.8,
            "beta2": 0.99,
            "initialAccumulatorValue": 0.0,
        },
        "dense": {"dlrm": {"bottom": [16], "top": [16, 8]}},
        "batchSize": 8,
        "bagSize": 4,
        "datasetSize": 64,
        "denseFeatures": 13,
        "data": {"criteo": {"train": "/data/train.tsv", "val": "/data/val.tsv"}},
        "gpusPerTrainer": 0,
        "backend": "gloo",
        **COMMON,
    },
}
FULL["HybridJob"]["optimizer"] = {
    "name": "adam",
    "lr": 0.01,
    "weightDecay": 0.0,
    "groups": [{"name": "no-decay", "preset": "noDecay"}],
}
# AdamW with every parameter-group field (issue 58).
FULL["PipelineJob"]["optimizer"] = {
    "name": "adamw",
    "lr": 0.01,
    "beta1": 0.9,
    "beta2": 0.95,
    "weightDecay": 0.1,
    "clipGradNorm": 1.0,
    "schedule": {"warmupSteps": 2, "decay": "cosine", "minLr": 0.001},
    "groups": [
        {"name": "head", "params": ["head.*"], "maxDims": 2, "weightDecay": 0.0, "lrScale": 10},
        {"name": "no-decay", "preset": "noDecay"},
    ],
    "layerDecay": {"rate": 0.75, "layers": 4, "blocks": "blocks", "stem": ["tok_emb.*"]},
}
FULL["PipelineJob"]["eval"] = {
    "everySteps": 5,
    "batches": 2,
    "best": {"metric": "perplexity", "mode": "min"},
    "earlyStopping": {"patience": 3, "minDelta": 0.01},
}
FULL["HybridJob"]["scheduling"] = {
    "provider": "coscheduling",
    "scheduleTimeoutSeconds": 60,
    "schedulerName": "scheduler-plugins-scheduler",
}
# Kueue's topology-aware scheduling and a MultiKueue job: on the PipelineJob (Kueue) only.
FULL["PipelineJob"]["scheduling"] = {"provider": "kueue", "queue": "q", "priorityClassName": "p"}
FULL["PipelineJob"]["topology"] = {"required": "cloud.provider.com/topology-rack"}
FULL["HybridJob"]["managedBy"] = "kueue.x-k8s.io/multikueue"


def seeds() -> list[dict]:
    """Every valid manifest to start from: the examples and FULL, each kind's."""
    out = []
    for path in sorted(ROOT.glob("examples/**/*.yaml")):
        doc = yaml.safe_load(path.read_text())
        if isinstance(doc, dict) and doc.get("kind") in KINDS and renders(doc):
            out.append(doc)
    for kind, body in FULL.items():
        doc = {
            "apiVersion": spec.API_VERSION,
            "kind": kind,
            "metadata": {"name": "fuzz"},
            "spec": copy.deepcopy(body),
        }
        spec.parse(doc, cluster=True)
        out.append(doc)
    return out


def renders(manifest: dict) -> bool:
    """Valid for every verb (an example that is not is test_examples.py's to report)."""
    try:
        spec.parse(copy.deepcopy(manifest), cluster=True)
    except spec.InvalidSpec:
        return False
    return True


def fields(schema: Field, where: Path_ = ("spec",)) -> Iterator[tuple[Path_, Field]]:
    """(path, Field) of every field the table names below `where`: object fields, a list's
    first item, a map's values (under key "k"). Kubernetes types are leaves."""
    if schema.k8s is not None:
        return
    for key, sub in (schema.fields or {}).items():
        yield (*where, key), sub
        yield from fields(sub, (*where, key))
    if schema.items is not None:
        yield (*where, 0), schema.items
        yield from fields(schema.items, (*where, 0))
    if schema.values is not None:
        yield (*where, "k"), schema.values


HUGE = [2**31, 2**63, 2**64, 10**400, 1e308, 1e300]
WRONG = [True, False, "text", 7, 2.5, [], {}, [1], {"x": 1}, None, "7", "1e3"]
SPECIAL = [0, 0.0, -0.0, -1, -2.5, -(2**63) - 1, math.nan, math.inf, -math.inf, "", " "]


def candidates(rng: random.Random, field: Field, current: Any) -> list[Any]:
    """Values to try for `field` (its current value `current`)."""
    out: list[Any] = [*WRONG, *SPECIAL, *HUGE]
    for bound in (field.minimum, field.maximum):
        if bound is not None:
            out += [bound - 1, bound, bound + 1, bound - 1e-9, bound + 1e-9, bound * 2]
    for member in field.enum or ():
        if isinstance(member, str):
            out += [
                member.upper(),
                member.capitalize(),
                member.swapcase(),
                f" {member}",
                f"{member}\n",
                member + "x",
            ]
    if field.enum:
        out += ["bogus", rng.choice(field.enum)]
    if field.type in ("string", "string-or-object", "int-or-string"):
        out += [
            "a b",
            "../x",
            "-x",
            "ü",
            "x" * 300,
            "x" * 70_000,
            "auto",
            "AUTO",
            "a:b",
            "m.n:f",
            "/abs/path",
            "\t",
        ]
    if isinstance(current, list):
        out += [current + current[:1], current * 2, [None], [current], current[:0]]
        out += [list(range(1 + (field.max_items or 70)))]
    if isinstance(current, dict):
        out += [{}, {**current, "extra": 1}, [current], {"k": current}]
    if current is not None:
        out += [current, [current], {"value": current}, str(current)]
    return out


def get(node: Any, path: Path_) -> Any:
    for key in path:
        if isinstance(node, dict) and isinstance(key, str) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return None
    return node


def put(manifest: dict, path: Path_, value: Any) -> bool:
    """Set `path` in `manifest` to `value`, making the mappings on the way (over what is
    there); False, and nothing changed, where a list item is missing."""
    changed = copy.deepcopy(manifest)
    if not _put(changed, path, value):
        return False
    manifest.clear()
    manifest.update(changed)
    return True


def _put(manifest: dict, path: Path_, value: Any) -> bool:
    node: Any = manifest
    for depth, key in enumerate(path):
        last = depth == len(path) - 1
        if isinstance(key, int):
            if not isinstance(node, list) or key >= len(node):
                return False
            if last:
                node[key] = value
                return True
            node = node[key]
        elif not isinstance(node, dict):
            return False
        elif last:
            node[key] = value
            return True
        elif isinstance(node.get(key), dict | list):
            node = node[key]
        elif isinstance(path[depth + 1], int):
            return False  # a list that is not there: no item to set
        else:
            node[key] = {}
            node = node[key]
    return False


def drop(manifest: dict, path: Path_) -> Any:
    parent = get(manifest, path[:-1])
    if isinstance(parent, dict) and path[-1] in parent:
        return parent.pop(path[-1])
    return None


@dataclass
class Mutation:
    path: Path_
    how: str
    names: tuple[str, ...]  # the field names an error may name

    def __str__(self) -> str:
        return f"{'.'.join(map(str, self.path))} {self.how}"


def _named(path: Path_) -> tuple[str, ...]:
    return tuple(str(k) for k in path if isinstance(k, str) and k != "spec")


def mutate_value(rng: random.Random, manifest: dict, path: Path_, field: Field) -> Mutation | None:
    value = rng.choice(candidates(rng, field, get(manifest, path)))
    if not put(manifest, path, copy.deepcopy(value)):
        return None
    return Mutation(path, f"= {_short(value)}", _named(path))


def move(rng: random.Random, manifest: dict, path: Path_) -> Mutation | None:
    """The field one level up (into its parent's parent) or down (into a sibling mapping,
    or a mapping of its own)."""
    if any(isinstance(k, int) for k in path) or len(path) < 2:
        return None
    value = get(manifest, path)
    if value is None:
        return None
    parent = get(manifest, path[:-1])
    if rng.random() < 0.5 and len(path) >= 3:
        drop(manifest, path)
        to = (*path[:-2], path[-1])
        put(manifest, to, value)
        return Mutation(path, f"moved up to {'.'.join(map(str, to))}", _named(path))
    siblings = [k for k, v in parent.items() if isinstance(v, dict) and k != path[-1]]
    drop(manifest, path)
    into = rng.choice(siblings) if siblings else path[-1]
    put(manifest, (*path[:-1], into, path[-1]), value)
    return Mutation(path, f"moved down into {into}", (*_named(path), str(into)))


def duplicate(rng: random.Random, manifest: dict, path: Path_, field: Field) -> Mutation | None:
    """A duplicate in a list (of named things, e.g. two tables of one name)."""
    value = get(manifest, path)
    if field.type != "array" or not isinstance(value, list) or not value:
        return None
    value.insert(rng.randrange(len(value) + 1), copy.deepcopy(rng.choice(value)))
    return Mutation(path, "duplicate item", _named(path))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 60 else f"{text[:40]}... ({len(text)} chars)"


Paths = dict[str, list[tuple[Path_, Field]]]


def mutated(rng: random.Random, seeds: list[dict], paths: Paths) -> tuple[dict, list[Mutation]]:
    """A seed with one to three mutations."""
    manifest = copy.deepcopy(rng.choice(seeds))
    done: list[Mutation] = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        path, field = rng.choice(paths[manifest["kind"]])
        roll = rng.random()
        if roll < 0.1:
            m = move(rng, manifest, path)
        elif roll < 0.17:
            m = duplicate(rng, manifest, path, field)
        else:
            m = mutate_value(rng, manifest, path, field)
        if m is not None:
            done.append(m)
    return manifest, done


def refusal_problem(error: spec.InvalidSpec, mutations: list[Mutation]) -> str | None:
    """What is wrong with a refusal: a line that is not one line, or too long, or no error
    naming any mutated field."""
    lines = [str(e) for e in error.errors]
    for line in lines:
        if "\n" in line or len(line) > MAX_LINE:
            return f"not one short line ({len(line)} chars): {line[:300]!r}"
    names = {n for m in mutations for n in m.names}
    if not any(n in line for line in lines for n in names):
        return f"no error names {sorted(names)}: {lines}"
    return None


def accepted_problem(job: spec.Job) -> str | None:
    """Run what `plan` and `render` run; then every role's trainer reads its env and builds
    its optimizers. A problem is returned as text; an exception propagates."""
    plan_world(job, kube.addresser(job))
    job.definition.describe(job.settings)
    objects = kube.render(job, "default", "trainer:1")
    yaml.dump_all(objects, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper))
    seen = set()
    for obj in objects:
        if obj.get("kind") != "Pod":
            continue
        role = kube.role_of(obj)
        if role in seen:
            continue
        seen.add(role)
        container = obj["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        trainer_accepts(env)
    return None


def trainer_accepts(env: dict[str, str]) -> None:
    """What a process does with its env before its world: read it (the spec through the
    kind's typed settings), and build its optimizers (torch refuses bad settings there)."""
    import torch

    from pipejob.trainer.hybrid import sparse_optimizers
    from pipejob.trainer.runtime import optim
    from pipejob.trainer.runtime.optim import optimizer_args
    from pipejob.trainer.runtime.world import read_env

    read = read_env(env)
    params = [torch.zeros(4, 2, requires_grad=True)]
    cls, kwargs = optimizer_args(read.spec.optimizer)
    cls(params, **kwargs)
    optim.build(read.spec.optimizer, [("w", params[0])])  # with its groups
    if read.kind == "HybridJob" and read.role == "ps":
        sparse_optimizers.make(params, read.spec.sparse_optimizer)


def check(manifest: dict, mutations: list[Mutation]) -> str | None:
    """None where the verbs and the trainer behave; else what went wrong."""
    try:
        try:
            spec.parse(copy.deepcopy(manifest))  # validate, plan
            job = spec.parse(copy.deepcopy(manifest), cluster=True)  # render
        except spec.InvalidSpec as e:
            return refusal_problem(e, mutations)
        return accepted_problem(job)
    except Exception:  # a traceback is the failure we look for
        return "traceback:\n" + traceback.format_exc(limit=-4)


def table_paths() -> Paths:
    return {name: list(fields(kind.spec)) for name, kind in KINDS.items()}


def run(examples: int, seed: int = 0, report: Any = None) -> list[str]:
    """Fuzz `examples` manifests from `seed`; each failure as text."""
    rng = random.Random(seed)
    starts, paths = seeds(), table_paths()
    failures = []
    for i in range(examples):
        manifest, mutations = mutated(rng, starts, paths)
        problem = check(manifest, mutations)
        if problem is not None:
            said = "; ".join(map(str, mutations))
            failures.append(f"example {i} ({manifest['kind']}: {said}): {problem}")
            if report is not None:
                print(failures[-1], file=report, flush=True)
    return failures


def sweep(seed: int = 0, per_field: int | None = None) -> tuple[int, list[str]]:
    """Every field of both kinds mutated on a seed of its kind: with each of its candidate
    values (`per_field` of them, drawn, where given), moved, and duplicated where it is a
    list. Returns the examples run and the failures."""
    rng = random.Random(seed)
    starts, failures, count = seeds(), [], 0
    for kind, paths in table_paths().items():
        mine = [s for s in starts if s["kind"] == kind]
        for path, field in paths:
            for manifest, mutation in _every(rng, mine, path, field, per_field):
                count += 1
                problem = check(manifest, [mutation])
                if problem is not None:
                    failures.append(f"{kind}: {mutation}: {problem}")
    return count, failures


def _every(
    rng: random.Random, mine: list[dict], path: Path_, field: Field, per_field: int | None
) -> Iterator[tuple[dict, Mutation]]:
    """The mutations of one field: its values on the seed with every section (FULL, the
    last of `mine`) and on one other seed, then a move and a duplicate."""
    for base in (mine[-1], rng.choice(mine[:-1])):
        values = candidates(rng, field, get(base, path))
        if per_field is not None:
            values = rng.sample(values, min(per_field, len(values)))
        for value in values:
            manifest = copy.deepcopy(base)
            if put(manifest, path, copy.deepcopy(value)):
                yield manifest, Mutation(path, f"= {_short(value)}", _named(path))
    for how in (move, duplicate):
        manifest = copy.deepcopy(mine[-1])
        mutation = how(rng, manifest, path) if how is move else how(rng, manifest, path, field)
        if mutation is not None:
            yield manifest, mutation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=1000, help="random manifests to try")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sweep", action="store_true", help="first every field with each of its candidate values"
    )
    args = parser.parse_args(argv)
    start, failures = time.monotonic(), []
    if args.sweep:
        count, failures = sweep(args.seed)
        print(*failures, sep="\n") if failures else None
        print(
            f"sweep: {count} examples in {time.monotonic() - start:.1f} s:"
            f" {len(failures)} failures",
            flush=True,
        )
    start = time.monotonic()
    failures += run(args.examples, args.seed, report=sys.stdout)
    took = time.monotonic() - start
    print(f"{args.examples} examples (seed {args.seed}) in {took:.1f} s: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
