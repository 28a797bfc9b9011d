"""Repository layout rules that no single package can check for itself: the namespace, each package's API,
the pure packages, no subprocess of another package's module, every duration default in a timeouts module,
every module listed in docs/architecture.md, and the sizes that keep the code readable (modules of at most
500 lines; functions of at most 80 in launch and rc, the packages that compose the running system)."""

from __future__ import annotations

import ast
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["schedule", "reconfig", "bench", "membership", "rc", "launch"]
PURE = {"schedule", "reconfig"}


def test_bamboo_is_a_namespace() -> None:
    offenders = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("packages/*/src/bamboo/__init__.py"))
    assert not offenders, f"bamboo must stay a PEP 420 namespace; remove {offenders}"


@pytest.mark.parametrize("part", PACKAGES)
def test_package_states_its_public_api(part: str) -> None:
    init = ROOT / "packages" / f"bamboo-{part}" / "src" / "bamboo" / part / "__init__.py"
    tree = ast.parse(init.read_text())
    assert ast.get_docstring(tree), f"{init} needs a module docstring"
    names = {t.id for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    assert "__all__" in names, f"{init} must state its public API in __all__"


@pytest.mark.parametrize("part", sorted(PURE))
def test_pure_packages_import_no_heavy_modules(part: str) -> None:
    # Importing the package in a fresh interpreter must not load torch, grpc or deepspeed.
    code = (
        f"import sys, bamboo.{part}; "
        "heavy = sorted(m for m in ('torch', 'grpc', 'deepspeed') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out == "", f"bamboo.{part} imported {out}"


def test_membership_does_not_import_torch_at_import_time() -> None:
    code = "import sys, bamboo.membership; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out == "False"


SOURCES = {part: ROOT / "packages" / f"bamboo-{part}" / "src" / "bamboo" / part for part in PACKAGES}
SCRIPTS = {f"bamboo-{part}": part for part in PACKAGES}


def _modules(part: str) -> list[Path]:
    """The source modules of ``bamboo.<part>`` (the generated gRPC stubs left out)."""
    return sorted(path for path in SOURCES[part].rglob("*.py") if "_pb2" not in path.name)


def _strings(node: ast.AST) -> list[str | None]:
    return [item.value if isinstance(item, ast.Constant) and isinstance(item.value, str) else None
            for item in getattr(node, "elts", [])]


def _started_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, target)`` of every command a module writes out: ``-m MODULE`` inside a list or tuple, and a
    console script at the head of one."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.List | ast.Tuple):
            continue
        words = _strings(node)
        found += [(node.lineno, target) for flag, target in itertools.pairwise(words)
                  if flag == "-m" and target is not None]
        if words and words[0] in SCRIPTS:
            found.append((node.lineno, words[0]))
    return found


@pytest.mark.parametrize("part", PACKAGES)
def test_no_package_starts_another_package_s_module(part: str) -> None:
    """A subprocess of another package's module path is an import the import contracts cannot see: a package
    starts only its own modules (and third-party ones, such as ``torch.distributed.run``)."""
    wrong = []
    for path in _modules(part):
        for line, target in _started_modules(ast.parse(path.read_text())):
            owner = SCRIPTS.get(target) or (target.split(".")[1] if target.startswith("bamboo.") else None)
            if owner is not None and owner != part:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: starts {target}")
    assert not wrong, "\n".join(wrong)


def test_the_subprocess_check_sees_a_foreign_module_path() -> None:
    tree = ast.parse('command = [sys.executable, "-m", "bamboo.launch", "measure"]\nother = ("bamboo-bench", "x")')
    assert _started_modules(tree) == [(1, "bamboo.launch"), (2, "bamboo-bench")]


def _duration_defaults(tree: ast.AST) -> list[tuple[int, str, float]]:
    """``(line, name, value)`` of every ``*_s`` default written as a number (not 0: no delay, no limit) in a
    module: constants, attrs fields, and parameters; ``*_per_s`` is a rate, not a duration."""
    found = []

    def note(name: str, value: ast.AST | None, line: int) -> None:
        if isinstance(value, ast.Call) and getattr(value.func, "attr", getattr(value.func, "id", "")) == "field":
            value = next((keyword.value for keyword in value.keywords if keyword.arg == "default"), None)
        if isinstance(value, ast.UnaryOp):
            value = value.operand
        if (name.lower().endswith("_s") and not name.lower().endswith("_per_s") and isinstance(value, ast.Constant)
                and isinstance(value.value, int | float) and not isinstance(value.value, bool) and value.value):
            found.append((line, name, value.value))

    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            note(node.target.id, node.value, node.lineno)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    note(target.id, node.value, node.lineno)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            arguments = node.args
            positional = arguments.posonlyargs + arguments.args
            for argument, default in zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults,
                                         strict=True):
                note(argument.arg, default, node.lineno)
            for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True):
                note(argument.arg, default, node.lineno)
    return found


@pytest.mark.parametrize("part", PACKAGES)
def test_every_duration_default_lives_in_a_timeouts_module(part: str) -> None:
    """Every default number of seconds is in one place: the package's ``timeouts`` module, where it is
    documented (and, for the running system, in the table of docs/failure-model.md)."""
    wrong = [f"{path.relative_to(ROOT)}:{line}: {name} = {value!r}" for path in _modules(part)
             if path.name != "timeouts.py" for line, name, value in _duration_defaults(ast.parse(path.read_text()))]
    assert not wrong, "move these defaults into a timeouts module:\n" + "\n".join(wrong)


def test_the_duration_check_sees_each_kind_of_default() -> None:
    tree = ast.parse("LEAD_S = 60.0\nclass A:\n    wait_s: float = attrs.field(default=2.0)\n    rate_per_s: float = 3.0\n"
                     "def f(timeout_s=5, *, poll_s=-0.1, none_s=0.0): ...")
    assert sorted((line, name, value) for line, name, value in _duration_defaults(tree)) == [
        (1, "LEAD_S", 60.0), (3, "wait_s", 2.0), (5, "poll_s", 0.1), (5, "timeout_s", 5)]


def test_docs_architecture_lists_every_module() -> None:
    """docs/architecture.md names every module of every package, under its package's entry."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Modules", 1)[1]
    missing = []
    for part in PACKAGES:
        entry = re.search(rf"^### `bamboo\.{part}`\n(.*?)(?=^### |\Z)", section, re.S | re.M)
        assert entry is not None, f"docs/architecture.md has no '### `bamboo.{part}`' entry under '## Modules'"
        named = set(re.findall(r"`([\w/]+\.py)`", entry.group(1)))
        for path in _modules(part):
            name = path.relative_to(SOURCES[part]).as_posix()
            if path.name not in ("__init__.py", "__main__.py") and name not in named:
                missing.append(f"bamboo.{part}: {name}")
    assert not missing, "docs/architecture.md does not list:\n" + "\n".join(missing)


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
FUNCTION_LIMITED = ("launch", "rc")


@pytest.mark.parametrize("part", PACKAGES)
def test_no_module_is_over_500_lines(part: str) -> None:
    long = [f"{path.relative_to(ROOT)}: {lines} lines" for path in _modules(part)
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"split these modules (at most {MAX_MODULE_LINES} lines):\n" + "\n".join(long)


def _long_functions(tree: ast.AST, limit: int) -> list[tuple[int, str, int]]:
    """``(line, name, lines)`` of every function or method over ``limit`` lines, its docstring included."""
    return [(node.lineno, node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > limit]


@pytest.mark.parametrize("part", FUNCTION_LIMITED)
def test_no_function_in_launch_and_rc_is_over_80_lines(part: str) -> None:
    long = [f"{path.relative_to(ROOT)}:{line}: {name} ({lines} lines)" for path in _modules(part)
            for line, name, lines in _long_functions(ast.parse(path.read_text()), MAX_FUNCTION_LINES)]
    assert not long, f"split these functions (at most {MAX_FUNCTION_LINES} lines):\n" + "\n".join(long)


def test_the_function_check_counts_from_def_to_the_last_line() -> None:
    def lines(indent: str, count: int) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(count))

    source = "def fits():\n" + lines("    ", 79) + "class A:\n    def too_long(self):\n" + lines("        ", 80)
    assert [(name, length) for _, name, length in _long_functions(ast.parse(source), MAX_FUNCTION_LINES)] == [
        ("too_long", 81)]
