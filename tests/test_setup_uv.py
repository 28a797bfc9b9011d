"""``scripts/uv_install.py``: setup.sh's uv installs from where pip would (pip's indexes, links, constraints and
certificate, its environment variables winning over its files)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent

LISTING = """global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels /srv/more-wheels'
:env:.index-url='https://mirror.example/simple'
"""


def _script() -> SimpleNamespace:
    """The script's functions (run as a module, not as ``__main__``)."""
    return SimpleNamespace(**runpy.run_path(str(ROOT / "scripts" / "uv_install.py")))


def test_pip_settings_read_every_scope_and_the_environment_wins() -> None:
    settings = _script().pip_settings(LISTING + "not a setting\n")
    assert settings == {"cert": "/etc/ssl/certs/ca-certificates.crt", "constraint": "/etc/xdg/pip/constraints.txt",
                        "extra-index-url": "file:///opt/pypi/simple file:///opt/pypi-more/simple",
                        "find-links": "/opt/wheels /srv/more-wheels", "index-url": "https://mirror.example/simple",
                        "default-timeout": "180"}


def test_uv_flags_carry_the_indexes_links_and_constraints_once_each() -> None:
    script = _script()
    flags = script.uv_flags(script.pip_settings(LISTING))
    assert flags == ["--index-strategy", "unsafe-best-match",
                     "--index-url", "https://mirror.example/simple",
                     "--extra-index-url", "file:///opt/pypi/simple",
                     "--extra-index-url", "file:///opt/pypi-more/simple",
                     "--find-links", "/opt/wheels", "--find-links", "/srv/more-wheels",
                     "--constraint", "/etc/xdg/pip/constraints.txt"]
    assert script.uv_flags({"no-index": "true"})[-1] == "--no-index"
    assert script.uv_flags({"trusted-host": "mirror.example"})[-2:] == ["--allow-insecure-host", "mirror.example"]
    assert script.uv_flags({}) == ["--index-strategy", "unsafe-best-match"]


def test_an_installed_requirement_is_left_as_it_is_without_the_network(tmp_path: Path) -> None:
    """The script runs the uv beside the environment's Python with pip's configuration: asked for what is already
    installed, it changes nothing and needs no index (PIP_INDEX_URL points nowhere that could answer)."""
    if not Path(sys.executable).with_name("uv").exists():
        pytest.skip("uv is not installed beside this Python (scripts/setup.sh installs it where it can)")
    env = {**os.environ, "PIP_INDEX_URL": (tmp_path / "no-index").as_uri(), "UV_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "uv_install.py"), "--dry-run", "pytest"],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    broken = subprocess.run([sys.executable, str(ROOT / "scripts" / "uv_install.py"), "--dry-run",
                             "bamboo-no-such-package-anywhere"], capture_output=True, text=True, timeout=120, env=env,
                            check=False)
    assert broken.returncode != 0  # what no index has fails, and setup.sh then tries pip
