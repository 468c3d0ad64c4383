"""A kind is declared in one place: its module in core/kinds/, registered in the registry.

- A toy kind registered in `pipejob.core.kinds.KINDS` (and nowhere else) is parsed, planned,
  rendered as Pods and a Service, gets its CRD, API reference, RBAC, metrics and the
  controller's attention, and reaches the trainer's env, with no other change.
- No module names a real kind outside its own declaration, and nothing parses a role back
  out of an RPC name.
- Each kind's typed spec (what the trainer reads) matches its table field by field, and
  every example manifest converts to it losslessly."""

from __future__ import annotations

import ast
import asyncio
import copy
import dataclasses
import functools
import operator
import types
import typing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import pipejob.core.kinds
from pipejob.core import contract as c
from pipejob.core import spec
from pipejob.core.common_spec import (
    COMMON,
    COMMON_RULES,
    OPERATOR_ONLY,
    CommonSpec,
    integer,
    spec_key,
)
from pipejob.core.elastic import Size
from pipejob.core.kind import Kind, ProcessGroup, Role
from pipejob.core.kinds import KINDS
from pipejob.core.plan import Ports, Seat, plan_world
from pipejob.core.schema import Field

# Every module that reads the registry, imported before any test registers its toy: what one
# computes at import (kopf's handlers, a permission list) cannot see the toy, nor keep it.
from pipejob.operator import apidoc, controller, crd, kube, rbac, reconcile
from pipejob.operator import status as st
from pipejob.operator.operator_metrics import PREFIX, OperatorMetrics

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("**/*.yaml"))  # and the folders of examples with code


# --- a) a toy kind, registered and nothing else --------------------------------------------

TOY_SPEC = Field(
    "object",
    "A toy job: a master and `workers` DDP workers.",
    fields={
        "workers": integer("Worker pods; they form the DDP group.", default=2, minimum=1),
        "gpusPerWorker": integer("GPUs per worker pod.", default=0, maximum=1),
        **COMMON,
    },
    rules=COMMON_RULES,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToySpec(CommonSpec):
    workers: int
    gpus_per_worker: int


TOY = Kind(
    name="ToyJob",
    plural="toyjobs",
    short_name="tj",
    description="A toy kind that exists only in this test.",
    spec=TOY_SPEC,
    settings=ToySpec,
    roles=(
        Role("master"),
        Role("worker", count="workers", gpus="gpus_per_worker", computes=True),
    ),
    groups=(
        ProcessGroup("ddp", "worker", backend=lambda s: "nccl" if s.gpus_per_worker else "gloo"),
    ),
    trainer="pipejob.trainer.toy",  # never imported here: only the trainer's pods do
    columns=({"name": "Workers", "type": "integer", "jsonPath": ".spec.workers", "priority": 1},),
)

REGISTERED = tuple(KINDS.values())  # the real kinds, before any test adds its toy

UID = "0b5e6f4a-0000-4000-8000-000000000042"


def toy_manifest(**fields: Any) -> dict:
    return {
        "apiVersion": spec.API_VERSION,
        "kind": "ToyJob",
        "metadata": {"name": "toy", "namespace": "ml", "uid": UID, "generation": 1},
        "spec": fields,
    }


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Kind:
    """The toy kind, registered for the test (the registry is the only thing touched)."""
    monkeypatch.setitem(KINDS, TOY.name, TOY)
    return TOY


def test_toy_kind_is_parsed_with_its_defaults_and_field_paths(toy: Kind) -> None:
    job = spec.parse(toy_manifest(workers=3))
    assert (job.kind, job.name, job.namespace) == ("ToyJob", "toy", "ml")
    assert job.definition is toy
    assert job.spec["workers"] == 3
    assert job.spec["gpusPerWorker"] == 0  # the table's default
    for name, field in COMMON.items():  # the common fields' defaults, filled in
        if field.default is not None:
            assert job.spec[name] == field.default, name
    assert job.spec["optimizer"]["name"] == COMMON["optimizer"].fields["name"].default
    assert "checkpoint" not in job.spec  # a section: absent unless written
    assert job.settings == ToySpec(
        steps=job.spec["steps"],
        seed=job.spec["seed"],
        optimizer=job.settings.optimizer,
        log_every=job.spec["logEvery"],
        rendezvous_timeout_seconds=job.spec["rendezvousTimeoutSeconds"],
        preflight=job.settings.preflight,
        workers=3,
        gpus_per_worker=0,
    )
    with pytest.raises(spec.InvalidSpec) as refused:
        spec.parse(toy_manifest(workers=0, stages=2))
    paths = {e.path for e in refused.value.errors}
    assert paths == {"spec.workers", "spec.stages"}  # out of range; another kind's field


def test_toy_kind_is_planned_from_its_roles_and_groups(toy: Kind) -> None:
    job = spec.parse(toy_manifest(workers=3, gpusPerWorker=1))
    ports = Ports()
    world = plan_world(job, lambda m: f"toy-{m.label}.toy", ports)
    assert [(p.rank, p.role, p.member.index, p.rpc_name) for p in world] == [
        (0, "master", 0, "master"),
        (1, "worker", 0, "worker0"),
        (2, "worker", 1, "worker1"),
        (3, "worker", 2, "worker2"),
    ]
    assert [p.gpus for p in world] == [0, 1, 1, 1]
    assert world[0].seat is None
    for i, p in enumerate(world[1:]):
        assert p.seat == Seat("ddp", i, 3, "toy-worker-0.toy", ports.ddp, "nccl")
        assert p.env[c.DDP_GROUP] == "ddp"
        assert p.env[c.DDP_RANK] == str(i)
    for p in world:
        assert p.world_size == 4
        assert p.env[c.KIND] == "ToyJob"
        assert p.env[c.WORLD] == "master,worker0,worker1,worker2"
        assert p.env[c.ROLES] == "master,worker,worker,worker"
        assert p.env[c.MASTER_ADDR] == "toy-master-0.toy"


def test_toy_kind_is_rendered_as_a_service_and_pods(toy: Kind) -> None:
    job = spec.parse(toy_manifest(workers=2, gpusPerWorker=1))
    service, policy, *pods = kube.render(job, "ml", image="trainer:test")
    assert (service["kind"], policy["kind"]) == ("Service", "NetworkPolicy")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == {"rpc": 29500, "ddp": 29501, "preflight": 29502, "monitor": 29503}
    assert [p["metadata"]["name"] for p in pods] == ["toy-master-0", "toy-worker-0", "toy-worker-1"]
    assert [kube.role_of(p) for p in pods] == ["master", "worker", "worker"]
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env[c.KIND] == "ToyJob"
        assert container["command"] == ["python", "-m", "pipejob.trainer"]
        names = {p["name"] for p in container["ports"]}
        gpus = (container.get("resources") or {}).get("limits", {}).get(kube.GPU, 0)
        if kube.role_of(pod) == "worker":
            assert "ddp" in names
            assert gpus == 1
        else:
            assert names == {"rpc", "preflight", "monitor"}
            assert gpus == 0


def test_toy_kind_is_reconciled_by_the_operator(toy: Kind) -> None:
    obj = toy_manifest(workers=2)
    acts = reconcile.decide(obj, [], datetime(2030, 1, 1, tzinfo=UTC), "trainer:test")
    assert acts.service is not None and acts.service["metadata"]["name"] == "toy"
    assert [p["metadata"]["name"] for p in acts.create] == [
        "toy-master-0",
        "toy-worker-0",
        "toy-worker-1",
    ]
    for pod in acts.create:
        assert pod["metadata"]["ownerReferences"] == [kube.owner_reference(obj)]
    assert acts.status["phase"] == "Pending"


def test_toy_kind_gets_its_crd_and_api_reference(toy: Kind, tmp_path: Path) -> None:
    made = crd.crd(toy)
    assert made["metadata"]["name"] == f"toyjobs.{spec.GROUP}"
    assert made["spec"]["names"] == {
        "kind": "ToyJob",
        "listKind": "ToyJobList",
        "plural": "toyjobs",
        "singular": "toyjob",
        "shortNames": ["tj"],
        "categories": [crd.CATEGORY],
    }
    (version,) = made["spec"]["versions"]
    columns = [col["name"] for col in version["additionalPrinterColumns"]]
    assert columns[: len(crd._COLUMNS)] == [col["name"] for col in crd._COLUMNS]
    assert "Workers" in columns
    properties = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert set(properties) == set(TOY_SPEC.fields)
    assert properties["workers"]["default"] == 2
    # `pipejob crds` writes one file per registered kind; the reference is made from them.
    assert f"toyjobs.{spec.GROUP}.yaml" in crd.generated()
    crd.write(tmp_path)
    reference = apidoc.render(tmp_path)
    assert "## ToyJob" in reference
    assert "| `spec.workers`" in reference


def test_toy_kind_gets_rbac(toy: Kind) -> None:
    """The operator's permissions on the toy kind are those it has on a real kind."""
    real = next(k for k in KINDS.values() if k is not toy)
    granted = rbac.grants()
    on_real = {g for g in granted if g[1].split("/")[0] == real.plural}
    assert on_real, f"no permissions on {real.plural}"
    on_toy = {(g, r.replace(real.plural, toy.plural, 1), v) for g, r, v in on_real}
    missing = sorted(on_toy - granted)
    assert not missing, (
        f"rbac.grants() lacks {missing}: operator/pipejob/operator/rbac.py computes the job"
        " resources once, at import, instead of from the registry when asked"
    )


def test_toy_kind_gets_metrics(toy: Kind) -> None:
    metrics = OperatorMetrics()
    created = f"{PREFIX}_jobs_created_total"
    assert metrics.registry.get_sample_value(created, {"kind": "ToyJob"}) == 0.0
    assert all(metrics.phases()[("ToyJob", phase)] == 0 for phase in st.PHASES)
    metrics.observe(("toyjobs", "ml", "toy"), "ToyJob", {}, {"phase": st.RUNNING})
    assert metrics.registry.get_sample_value(created, {"kind": "ToyJob"}) == 1.0
    assert metrics.phases()[("ToyJob", st.RUNNING)] == 1


def test_toy_kind_is_known_to_the_controller(toy: Kind) -> None:
    """Its plural names it in the metrics, and its pods' events reach its reconcile."""
    assert controller._kind_name("toyjobs") == "ToyJob"
    kicked = []
    reconciler = types.SimpleNamespace(
        jobs={("toyjobs", "ml", "toy")}, enqueue=lambda key: kicked.append(key)
    )
    ref = {"apiVersion": spec.API_VERSION, "kind": "ToyJob", "name": "toy", "controller": True}
    body = {"metadata": {"name": "toy-worker-0", "ownerReferences": [ref]}}
    memo = types.SimpleNamespace(reconciler=reconciler)
    asyncio.run(controller.on_pod(body=body, namespace="ml", memo=memo))
    assert kicked == [("toyjobs", "ml", "toy")]


def test_controller_watches_every_registered_kind() -> None:
    """kopf's handlers are registered at import, one per kind of the registry (read once,
    when the operator starts: the toy, registered later, is not among them)."""
    watched = {}
    for handler in controller.REGISTRY._watching.get_all_handlers():
        selector = handler.selector
        if selector.group == spec.GROUP:
            assert selector.version == spec.VERSION
            watched[selector.any_name or selector.plural] = handler.fn
    assert set(watched) == {k.plural for k in REGISTERED}
    assert set(watched.values()) == {controller.on_job}


def test_toy_kind_reaches_the_trainer_env(toy: Kind) -> None:
    """The trainer reads the kind and its typed spec from the env the plan gives."""
    world = pytest.importorskip("pipejob.trainer.runtime.world")

    job = spec.parse(toy_manifest(workers=2))
    processes = plan_world(job, lambda m: "127.0.0.1", Ports(groups=(29600,)))
    env = world.read_env(processes[2].env)
    assert env.definition is toy
    assert env.spec == job.settings
    assert (env.role, env.role_index, env.rpc_name) == ("worker", 1, "worker1")
    assert (env.ddp_group, env.ddp_rank, env.ddp_world_size) == ("ddp", 1, 2)
    assert env.names("worker") == ["worker0", "worker1"]


def test_toy_kind_typed_spec_matches_its_table(toy: Kind) -> None:
    assert _drift(toy) == []


# --- b) no kind named outside its declaration; no role parsed out of a name ---------------

OPERATOR_ROOT = ROOT / "operator" / "pipejob"
TRAINER_ROOT = ROOT / "trainer" / "pipejob" / "trainer"


def _sources(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module and its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    out.add(id(body[0].value))
    return out


def _strings(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every string constant of the module but its docstrings."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _docstrings(tree)
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
    ]


def _declared_in() -> dict[str, Path]:
    """{kind name: the module of core/kinds/ whose `Kind(name=...)` declares it}."""
    out: dict[str, Path] = {}
    for path in sorted(Path(pipejob.core.kinds.__path__[0]).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Kind":
                named = [k.value for k in node.keywords if k.arg == "name"] or node.args[:1]
                if named and isinstance(named[0], ast.Constant):
                    assert named[0].value not in out, f"{named[0].value} declared twice"
                    out[named[0].value] = path.resolve()
    return out


def test_every_kind_is_declared_in_its_own_module() -> None:
    homes = _declared_in()
    assert set(homes) == set(KINDS), "every registered kind comes from core/kinds/<module>.py"
    assert len(set(homes.values())) == len(homes), "one module per kind"
    assert {p.name for p in homes.values()} >= {"pipeline.py", "hybrid.py"}


def test_kind_names_appear_only_in_their_declaration() -> None:
    homes = _declared_in()
    names = {
        value: kind.name
        for kind in KINDS.values()
        for value in (kind.name, kind.plural, kind.short_name)
    }
    assert {"PipelineJob", "HybridJob", "pipelinejobs", "hybridjobs", "pj", "hj"} <= set(names)
    found = []
    for path in _sources(OPERATOR_ROOT, TRAINER_ROOT):
        for line, value in _strings(path):
            if value in names and path.resolve() != homes.get(names[value]):
                found.append(f"{path.relative_to(ROOT)}:{line}: {value!r}")
    assert not found, (
        "a kind's names belong in its module in core/kinds/; elsewhere, read them from the"
        " Kind (job.definition, KINDS) or declare the behaviour on the Kind:\n  "
        + "\n  ".join(found)
    )


def _strips_digits(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    if node.func.attr not in ("rstrip", "strip") or not node.args:
        return False
    arg = node.args[0]
    if isinstance(arg, ast.Attribute) and arg.attr == "digits":  # string.digits
        return True
    return (
        isinstance(arg, ast.Constant)
        and isinstance(arg.value, str)
        and any(ch.isdigit() for ch in arg.value)
    )


def test_no_role_is_parsed_back_out_of_a_name() -> None:
    """Roles travel as data (the plan's Member, PIPEJOB_ROLE and PIPEJOB_ROLES), never
    recovered from an RPC name by stripping its index (`"stage1".rstrip("0123456789")`)."""
    found = []
    for path in _sources(ROOT / "operator", ROOT / "trainer"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if _strips_digits(node):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "names parsed back into roles:\n  " + "\n  ".join(found)


# --- c) the typed spec matches its table --------------------------------------------------

SCALARS = {"integer": int, "number": float, "string": str, "boolean": bool}


def _minimal(kind: Kind) -> dict:
    """The spec of a manifest that sets nothing: the table's defaults and the kind's fill-ins."""
    manifest = {"apiVersion": spec.API_VERSION, "kind": kind.name, "metadata": {"name": "m"}}
    return spec.parse(manifest).spec


def _lookup(data: Any, path: str) -> tuple[bool, bool]:
    """(whether the parent of `path` is in `data`, whether `path` is)."""
    *parents, last = path.split(".")
    for part in parents:
        if not isinstance(data, dict) or part not in data:
            return False, False
        data = data[part]
    return True, isinstance(data, dict) and last in data


def _may_be_absent(table: Field, parent: Field, name: str, path: str, minimal: dict) -> bool:
    """Can the field be missing from a defaulted spec? Sections can; so can fields without
    a default unless required, filled in as an object, or filled in by the kind's `complete`."""
    if table.section:
        return True
    if table.default is not None or name in parent.required or _filled_in(table):
        return False
    seen, present = _lookup(minimal, path)
    return not (seen and present)


def _filled_in(table: Field) -> bool:
    return (
        table.type == "object"
        and not table.section
        and any(f.default is not None or _filled_in(f) for f in (table.fields or {}).values())
    )


def _type_drift(hint: Any, table: Field, path: str, minimal: dict) -> list[str]:
    """How `hint` (None stripped) disagrees with the table's type at `path`."""
    if table.type in SCALARS:
        want = SCALARS[table.type]
        return [] if hint is want else [f"{path}: {table.type} is {want.__name__}, typed {hint}"]
    if table.type == "int-or-string":
        ok = isinstance(hint, types.UnionType) and set(hint.__args__) == {int, str}
        return [] if ok else [f"{path}: int-or-string is int | str, typed {hint}"]
    if table.type == "int-or-object":  # a size: n reads as {min: n, max: n}
        return [] if hint is Size else [f"{path}: int-or-object is Size, typed {hint}"]
    if table.type == "array":
        args = typing.get_args(hint)
        if typing.get_origin(hint) is not tuple or len(args) != 2 or args[1] is not Ellipsis:
            return [f"{path}: array is tuple[X, ...], typed {hint}"]
        return _type_drift(args[0], table.items, f"{path}[]", minimal) if table.items else []
    if table.type in ("object", "string-or-object") and table.fields and table.k8s is None:
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            return [f"{path}: object with fields is a dataclass, typed {hint}"]
        return _class_drift(hint, table, path, minimal)
    if table.type == "object":  # a map, a Kubernetes object, free form: a dict
        if typing.get_origin(hint) is not dict and hint is not dict:
            return [f"{path}: object is dict[str, ...], typed {hint}"]
        return []
    return [f"{path}: no Python type for {table.type}"]


def _class_drift(cls: type, table: Field, prefix: str, minimal: dict) -> list[str]:
    """Every disagreement between the dataclass `cls` and the object field `table`."""
    problems = []
    hints = typing.get_type_hints(cls)
    fields = table.fields or {}
    typed = {spec_key(f.name): f for f in dataclasses.fields(cls)}
    for name, f in typed.items():
        path = f"{prefix}.{name}" if prefix else name
        where = f"{cls.__name__}.{f.name}"
        if name not in fields:
            problems.append(f"{where}: no field {path} in the table")
            continue
        if path in OPERATOR_ONLY:
            problems.append(f"{where}: {path} is in OPERATOR_ONLY yet typed for the trainer")
        hint = hints[f.name]
        optional = isinstance(hint, types.UnionType) and type(None) in hint.__args__
        if optional:
            hint = functools.reduce(operator.or_, [a for a in hint.__args__ if a is not type(None)])
        # A string-or-object's fields are never filled in by `complete` (it only expands
        # the string shortcut), so the minimal spec says nothing about them.
        seen = {} if table.type == "string-or-object" else minimal
        absent = _may_be_absent(fields[name], table, name, path, seen)
        # An absent field reads as its dataclass default: None, or an empty value (args {},
        # splitPoints (), Loss()) where the trainer wants one.
        defaulted = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        if absent and not optional and not defaulted:
            problems.append(
                f"{where}: {path} may be absent from a spec: type it X | None ="
                " None, or give it an empty default"
            )
        if optional and not absent:
            problems.append(f"{where}: {path} is always in a defaulted spec: drop the | None")
        if optional and f.default is not None:
            problems.append(f"{where}: optional, so its default must be None")
        problems += _type_drift(hint, fields[name], path, minimal)
    for name in fields:
        path = f"{prefix}.{name}" if prefix else name
        if name not in typed and path not in OPERATOR_ONLY:
            problems.append(
                f"{cls.__name__}: no field for {path} (add `{_snake(name)}`, or list {path!r}"
                " in OPERATOR_ONLY if only the operator reads it)"
            )
    return problems


def _snake(name: str) -> str:
    return "".join(f"_{ch.lower()}" if ch.isupper() else ch for ch in name)


def _drift(kind: Kind) -> list[str]:
    assert dataclasses.is_dataclass(kind.settings), f"{kind.name}.settings is not a dataclass"
    assert issubclass(kind.settings, CommonSpec), f"{kind.name}.settings is not a CommonSpec"
    return _class_drift(kind.settings, kind.spec, "", _minimal(kind))


def _table_has(table: Field, path: str) -> bool:
    for part in path.split("."):
        if not table.fields or part not in table.fields:
            return False
        table = table.fields[part]
    return True


@pytest.mark.parametrize("kind", list(KINDS.values()), ids=lambda k: k.name)
def test_typed_spec_matches_the_table(kind: Kind) -> None:
    problems = _drift(kind)
    assert not problems, f"{kind.name}.settings disagrees with its table:\n  " + "\n  ".join(
        problems
    )


@pytest.mark.parametrize("kind", list(KINDS.values()), ids=lambda k: k.name)
def test_operator_only_fields_exist(kind: Kind) -> None:
    missing = [path for path in OPERATOR_ONLY if not _table_has(kind.spec, path)]
    assert not missing, f"OPERATOR_ONLY names fields {kind.name} does not have: {missing}"


def test_key_is_the_camel_case_of_a_field() -> None:
    assert spec_key("weight_decay") == "weightDecay"
    assert spec_key("rendezvous_timeout_seconds") == "rendezvousTimeoutSeconds"
    assert spec_key("lr") == "lr"
    assert all(
        spec_key(_snake(name)) == name for kind in KINDS.values() for name in kind.spec.fields
    )


def _as_spec(value: Any) -> Any:
    """A typed spec back as the manifest writes it (camelCase keys, lists, absent for None,
    a size that is no range as its number)."""
    if isinstance(value, Size) and not value.elastic:
        return value.max
    if dataclasses.is_dataclass(value):
        return {
            spec_key(f.name): _as_spec(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None
        }
    if isinstance(value, tuple):
        return [_as_spec(v) for v in value]
    return value


def _pruned(value: Any) -> Any:
    """`value` without empty mappings and lists: an absent field and its empty default
    (args {}, splitPoints (), Loss()) say the same."""
    if isinstance(value, dict):
        out = {k: _pruned(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in ({}, [])}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def _trainer_view(data: dict) -> dict:
    """The spec without the fields only the operator reads."""
    out = copy.deepcopy(data)
    for path in OPERATOR_ONLY:
        *parents, last = path.split(".")
        inner = out
        for part in parents:
            inner = inner.get(part) if isinstance(inner, dict) else None
        if isinstance(inner, dict):
            inner.pop(last, None)
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_example_converts_to_its_typed_spec(path: Path) -> None:
    job = spec.load(path)
    settings = job.settings
    assert isinstance(settings, job.definition.settings)
    assert _pruned(_as_spec(settings)) == _pruned(_trainer_view(job.spec))


def test_there_are_examples_of_every_kind() -> None:
    assert {spec.load(p).kind for p in EXAMPLES} == set(KINDS)
