"""Folders are import paths, and each side of the project keeps to its own dependencies.

- Every package folder under operator/pipejob and trainer/pipejob/trainer is listed in
  pyproject.toml's `packages` and maps back to its folder through `package-dir`, and every
  listed package is such a folder: nothing is left out of the wheel, nothing shadowed.
- The operator side (operator/pipejob: core, operator, runner, cli) never imports torch; the
  trainer never imports kopf or the Kubernetes client.
- Every module says what it is for in a docstring, and stays under 400 lines unless that
  docstring says why it is longer ("over 400 lines because ...", "long because ...").
- A reader takes each function in at once (60 lines at most), tells modules and classes
  apart by their names, and reads the formatter's one style (no line opts out of it).
- Past the parser and the Kubernetes boundary no signature takes or returns an untyped
  mapping, and such a mapping has a name only where it crosses a boundary."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
OPERATOR = ROOT / "operator" / "pipejob"
TRAINER = ROOT / "trainer" / "pipejob" / "trainer"

MAX_LINES = 400
LONG_BECAUSE = re.compile(r"over 400 lines|long because", re.IGNORECASE)

# Top-level imports each side must never make (the operator image has no torch; the trainer
# image has no kopf or kubernetes client).
NEVER = {
    OPERATOR: {"torch", "torchvision"},
    TRAINER: {"kopf", "kubernetes"},
}
# The parts of `pipejob` the trainer may import: the shared, torch-free core and its own.
TRAINER_MAY_IMPORT = ("pipejob.core", "pipejob.trainer")


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _folder_of(package: str, package_dir: dict[str, str]) -> Path:
    """Where setuptools looks for `package`: under its longest mapped prefix."""
    prefixes = [p for p in package_dir if package == p or package.startswith(p + ".")]
    assert prefixes, f"{package} is under no package-dir entry"
    prefix = max(prefixes, key=len)
    rest = package[len(prefix) :].lstrip(".")
    return (ROOT / package_dir[prefix]).joinpath(*rest.split(".") if rest else ())


def _package_folders(package_dir: dict[str, str]) -> dict[str, Path]:
    """{package name: folder} of every folder with an __init__.py under a package-dir root."""
    out = {}
    for prefix, folder in package_dir.items():
        root = ROOT / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            out[".".join((prefix, *rel.parts))] = init.parent
    return out


def test_package_dir_roots_are_the_two_source_folders() -> None:
    package_dir = _setuptools()["package-dir"]
    assert package_dir == {
        "pipejob": "operator/pipejob",
        "pipejob.trainer": "trainer/pipejob/trainer",
    }


def test_every_package_folder_is_listed_and_every_listed_package_exists() -> None:
    setuptools = _setuptools()
    package_dir, listed = setuptools["package-dir"], setuptools["packages"]
    assert len(listed) == len(set(listed)), "a package is listed twice"
    for package in listed:
        folder = _folder_of(package, package_dir)
        assert (folder / "__init__.py").is_file(), f"{package}: no {folder.relative_to(ROOT)}"
    found = _package_folders(package_dir)
    unlisted = sorted(set(found) - set(listed))
    assert not unlisted, f"package folders missing from pyproject.toml's packages: {unlisted}"
    for package, folder in found.items():  # e.g. an operator/pipejob/trainer/ would be hidden
        assert _folder_of(package, package_dir) == folder, (
            f"{folder.relative_to(ROOT)} is package {package}, which imports from"
            f" {_folder_of(package, package_dir).relative_to(ROOT)}"
        )


def test_every_folder_of_modules_is_a_package() -> None:
    """A folder of modules without __init__.py would be a namespace package, left out of
    the wheel (setuptools ships only the packages listed)."""
    for root in (OPERATOR, TRAINER):
        for folder in {p.parent for p in _modules(root)}:
            assert (folder / "__init__.py").is_file(), f"{folder.relative_to(ROOT)}: no __init__.py"


@pytest.mark.parametrize(
    "path", [*_modules(OPERATOR), *_modules(TRAINER)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_module_has_a_docstring_and_a_reason_to_be_long(path: Path) -> None:
    text = path.read_text()
    docstring = ast.get_docstring(ast.parse(text, str(path)))
    assert docstring and docstring.strip(), "every module says what it is for in a docstring"
    lines = len(text.splitlines())
    assert lines <= MAX_LINES or LONG_BECAUSE.search(docstring), (
        f"{lines} lines: split the module, or say in its docstring why it is over"
        f' {MAX_LINES} lines ("over {MAX_LINES} lines because ...")'
    )


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import, at any depth, and of every
    importlib.import_module / __import__ of a constant name."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args:
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            arg = node.args[0]
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant):
                if isinstance(arg.value, str) and not arg.value.startswith("."):
                    out.append((node.lineno, arg.value))
    return out


@pytest.mark.parametrize("root", list(NEVER), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_side_never_imports_the_others_dependencies(root: Path) -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in _modules(root)
        for line, name in _imports(path)
        if name.split(".")[0] in NEVER[root]
    ]
    assert not found, f"imports of {sorted(NEVER[root])}:\n  " + "\n  ".join(found)


def test_the_operator_side_never_imports_the_trainer() -> None:
    """pipejob.trainer imports torch: the operator names its modules (Kind.trainer) as data."""
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in _modules(OPERATOR)
        for line, name in _imports(path)
        if name == "pipejob.trainer" or name.startswith("pipejob.trainer.")
    ]
    assert not found, "\n  ".join(["the operator side imports the trainer:", *found])


def test_the_trainer_imports_only_core_of_the_operator_side() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in _modules(TRAINER)
        for line, name in _imports(path)
        if (name == "pipejob" or name.startswith("pipejob."))
        and not any(name == p or name.startswith(p + ".") for p in TRAINER_MAY_IMPORT)
    ]
    assert not found, "\n  ".join(["the trainer imports beyond pipejob.core:", *found])


def _module_name(path: Path) -> str:
    parts = path.relative_to(OPERATOR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_importing_the_whole_operator_side_loads_no_torch() -> None:
    """The same, as Python sees it: every module of operator/pipejob imported in a fresh
    interpreter leaves torch and torchvision unloaded, however they would be reached."""
    names = [_module_name(p) for p in _modules(OPERATOR) if p.name != "__main__.py"]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch', 'torchvision') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"loaded with the operator side: {done.stdout.strip()}"


# A Stage or Reader method named by a string in a call to a stage process: `rpc.rpc_async(name,
# on_stage, args=(stage, "save", ...))`, `pipeline.each("timings")`. The typed calls of
# pipeline/stage_calls.py take the method itself, so a misspelt one fails where it is written.
STRING_NAMED_CALL = re.compile(
    r"\bon_(?:stage|reader)\s*,\s*args\s*=\s*\(\s*[^,()]+,\s*[rbf]?[\"']"
    r"|\.(?:each|stage_results|reader|readers)\(\s*[rbf]?[\"']"
    r"|\bremote_(?:stage|reader)\([^()]*\)\s*\.\w+\(\s*[rbf]?[\"']"
    r"|\bevery_stage_result\(\s*[^,()]+,\s*[rbf]?[\"']"
)


def test_no_stage_call_names_its_method_by_a_string() -> None:
    bad = [
        'rpc.rpc_async(name, on_stage, args=(stage, "save", directory))',
        "rpc.remote(self.names[0], on_reader, args=(self.stages[0], 'labels', 3))",
        'pipeline.each("timings")',
        'remote_stage(self.stages[k]).future("gradient", context_id)',
        "every_stage_result(stages, 'timings')",
    ]
    assert all(STRING_NAMED_CALL.search(line) for line in bad)
    assert not STRING_NAMED_CALL.search("remote_stage(stage).future(StageBase.save, directory)")
    found = [
        f"{path.relative_to(ROOT)}:{path.read_text()[: m.start()].count(chr(10)) + 1}"
        for path in [*_modules(OPERATOR), *_modules(TRAINER)]
        for m in STRING_NAMED_CALL.finditer(path.read_text())
    ]
    assert not found, f"name the Stage method itself (pipeline/stage_calls.py): {found}"


MAX_FUNCTION_LINES = 60
# Modules named alike on purpose: the two engines' siblings (pipeline/rpc/, pipeline/pipelining/)
# beside the driver they share (pipeline/driver.py), and a package's own markers.
SIBLING_NAMES = {"__init__.py", "__main__.py", "driver.py", "stage.py"}


@pytest.mark.parametrize(
    "path", [*_modules(OPERATOR), *_modules(TRAINER)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_function_reads_at_once(path: Path) -> None:
    long = [
        f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"over {MAX_FUNCTION_LINES} lines, split by what each part decides: {long}"


def test_no_two_modules_share_a_name_a_reader_must_tell_apart() -> None:
    by_name: dict[str, list[str]] = {}
    for path in [*_modules(OPERATOR), *_modules(TRAINER)]:
        by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    alike = {n: paths for n, paths in by_name.items() if len(paths) > 1 and n not in SIBLING_NAMES}
    assert not alike, f"name each for what it holds: {alike}"


def _classes() -> dict[str, set[str]]:
    """{class name: the modules defining it}, paths under operator/pipejob or the trainer."""
    by_name: dict[str, set[str]] = {}
    for root in (OPERATOR, TRAINER):
        for path in _modules(root):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    by_name.setdefault(node.name, set()).add(str(path.relative_to(root)))
    return by_name


def test_no_two_classes_share_a_name() -> None:
    """One name per class across operator/ and the trainer (issue 62; docs/architecture.md,
    "Glossary"): a subclass says what it adds (`RpcReplicas`), a base says it is one
    (`ReplicasBase`)."""
    shared = {name: sorted(paths) for name, paths in _classes().items() if len(paths) > 1}
    assert not shared, f"name each class for what it is (the glossary's word): {shared}"


def test_the_formatter_is_switched_off_nowhere() -> None:
    found = subprocess.run(
        ["git", "grep", "-n", "-E", "fmt: (skip|off)", "--", "*.py", ":!tests/test_layout.py"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert found.returncode in (0, 1), found.stderr  # 1: git found none
    assert not found.stdout, f"configure the formatter in pyproject.toml instead: {found.stdout}"


# Where a mapping's shape is not ours: the parser reads the manifest as written, Kubernetes
# sends its objects. Past these modules the spec is its kind's typed settings and our own
# shapes are dataclasses or TypedDicts (issue 62).
PARSER_AND_KUBERNETES = (
    "core/spec.py",
    "core/schema.py",
    "core/validate.py",
    "core/common_spec.py",
    "core/kinds/",
    "core/k8s.py",
    "operator/kube.py",
    "operator/apidoc.py",
)
# The untyped shapes that cross a boundary, each named where it is defined: a Kubernetes
# object, what torch's state_dict() gives, the spec as the parser (and a pod's env) holds it,
# the keyword arguments a user's module is called with.
BOUNDARY_TYPES = {"KubeObject", "TorchState", "RawSpec", "ForwardKwargs"}
UNTYPED = re.compile(r"\bdict\b(?!\[)|\b(dict|Dict|Mapping|MutableMapping)\[str, (Any|object)\]")


def _past_the_parser(path: Path) -> bool:
    if not path.is_relative_to(OPERATOR):
        return True
    return not str(path.relative_to(OPERATOR)).startswith(PARSER_AND_KUBERNETES)


def _annotations(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[str]:
    a = node.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
    for note in [*(p.annotation for p in params if p is not None), node.returns]:
        if note is not None:
            yield ast.unparse(note)


def test_no_untyped_mapping_in_a_signature_past_the_parser() -> None:
    """Past the parser and the Kubernetes boundary a function takes and returns typed shapes
    (docs/architecture.md, "Glossary")."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {note}"
        for path in [*_modules(OPERATOR), *_modules(TRAINER)]
        if _past_the_parser(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for note in _annotations(node)
        if UNTYPED.search(note)
    ]
    assert not found, f"type these (a dataclass, a TypedDict or a boundary type): {found}"


def test_an_untyped_mapping_is_named_only_at_a_boundary() -> None:
    """An alias of `dict[str, Any]` is one of the boundary types, so the rule above is not
    passed by a new name for the same thing."""
    named = {
        target.id: str(path.relative_to(ROOT))
        for path in [*_modules(OPERATOR), *_modules(TRAINER)]
        for node in ast.parse(path.read_text(), str(path)).body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and node.value is not None
        and UNTYPED.fullmatch(ast.unparse(node.value))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }
    assert set(named) <= BOUNDARY_TYPES, f"type these shapes instead: {named}"
