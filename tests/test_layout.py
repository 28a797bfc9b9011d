"""Repository layout rules from DESIGN.md that no single package can check for itself."""

from __future__ import annotations

import ast
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
