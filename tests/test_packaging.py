"""Packaging checks: every package builds a wheel whose metadata keeps the dependency rules of docs/architecture.md.

- `bamboo-schedule` and `bamboo-reconfig` are pure: no torch, grpcio or deepspeed.
- `bamboo-membership` does not depend on torch (only through its optional `torch` extra).
- `bamboo` is a PEP 420 namespace: no wheel ships `bamboo/__init__.py`.
- `bamboo-schedule`'s wheel installed into an empty venv pulls attrs and nothing heavy, and imports.
"""

from __future__ import annotations

import email
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["schedule", "reconfig", "bench", "membership", "rc", "launch"]
SCRIPTS = {"schedule", "reconfig", "bench", "launch", "rc"}
HEAVY = {"torch", "grpcio", "deepspeed"}
FORBIDDEN = {"schedule": HEAVY, "reconfig": HEAVY, "membership": {"torch", "deepspeed"}}


def _requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _build_wheels(tmp: Path) -> dict[str, Path]:
    """Every package's wheel, built by one pip process from copies of the sources (so that the editable
    install's egg-info in the source tree is left alone)."""
    sources = []
    for part in PACKAGES:
        src = tmp / f"bamboo-{part}"
        shutil.copytree(
            ROOT / "packages" / f"bamboo-{part}",
            src,
            ignore=shutil.ignore_patterns("*.egg-info", "build", "dist", "__pycache__", "tests"),
        )
        sources.append(str(src))
    out = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out),
         *sources],
        check=True,
        capture_output=True,
        text=True,
    )
    return {part: next(out.glob(f"bamboo_{part}-0.1.0-*.whl")) for part in PACKAGES}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _build_wheels(tmp_path_factory.mktemp("wheels"))


@pytest.mark.parametrize("part", PACKAGES)
def test_wheel_metadata(wheels: dict[str, Path], part: str) -> None:
    with zipfile.ZipFile(wheels[part]) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(zf.read(meta_name))
        entry_points = next((zf.read(n).decode() for n in names if n.endswith("entry_points.txt")), "")
    assert meta["Name"] == f"bamboo-{part}"
    assert meta["Version"] == "0.1.0"
    assert "bamboo/__init__.py" not in names, f"bamboo-{part} ships bamboo/__init__.py: breaks the namespace"
    assert f"bamboo/{part}/__init__.py" in names
    requires = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    deps = {_requirement_name(r) for r in requires}
    bad = deps & FORBIDDEN.get(part, set())
    assert not bad, f"bamboo-{part} must not depend on {sorted(bad)}; Requires-Dist: {requires}"
    if part in SCRIPTS:
        assert f"bamboo-{part} = bamboo.{part}.cli:main" in entry_points


def test_schedule_installs_alone_in_an_empty_venv(wheels: dict[str, Path], tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(py)]  # this pip, installing into the empty venv
    subprocess.run([*pip, "install", "-q", str(wheels["schedule"])], check=True, capture_output=True, text=True)
    listed = subprocess.run([*pip, "list", "--format", "json"], check=True, capture_output=True, text=True).stdout
    installed = {p["name"].lower() for p in json.loads(listed)}
    extra = installed - {"bamboo-schedule", "attrs"}
    assert not extra, f"bamboo-schedule pulled in more than attrs: {sorted(extra)}"
    subprocess.run([str(py), "-c", "import bamboo.schedule"], check=True, cwd=tmp_path)
