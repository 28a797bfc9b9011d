"""Package hygiene: pure Python (no torch, grpc or deepspeed), docstrings, and a complete __all__."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import bamboo.schedule

SOURCE = Path(bamboo.schedule.__file__).parent
FORBIDDEN = ("torch", "grpc", "deepspeed")


def test_no_module_imports_torch_grpc_or_deepspeed() -> None:
    for path in SOURCE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_every_module_has_a_docstring_and_all_exports_exist() -> None:
    for path in SOURCE.glob("*.py"):
        module = importlib.import_module(f"bamboo.schedule.{path.stem}" if path.stem != "__init__" else "bamboo.schedule")
        assert module.__doc__ and module.__doc__.strip(), f"{path.name} has no docstring"
    for name in bamboo.schedule.__all__:
        assert hasattr(bamboo.schedule, name), name
    assert not (SOURCE.parent / "__init__.py").exists(), "bamboo must stay a PEP 420 namespace"
