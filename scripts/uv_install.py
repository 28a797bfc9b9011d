"""``uv pip install`` from where pip would install, for scripts/setup.sh: ``python scripts/uv_install.py ARGS...``.

uv installs the same packages as pip in about half the time (it unpacks wheels and builds in parallel), but it
reads none of pip's configuration. This reads it (``pip config list``: pip's files and its ``PIP_*`` variables, a
variable winning over a file) and runs the ``uv`` beside this Python, on this Python's environment, with the
equivalent:

- ``index-url``, ``extra-index-url``, ``find-links`` and ``constraint`` become uv's flags of the same names,
  ``trusted-host`` becomes ``--allow-insecure-host``, and ``no-index`` becomes ``--no-index``;
- ``cert`` becomes ``SSL_CERT_FILE``, which uv reads (unless that is already set);
- ``--index-strategy unsafe-best-match`` always: pip takes the best version from all its indexes together, uv by
  default only from the first index that has the package (a pin that only the second index holds would fail);
- ``default-timeout`` and any other key are left to uv's defaults.

It exits with uv's status; setup.sh installs with pip when that is not 0.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}


def pip_settings(listing: str) -> dict[str, str]:
    """``pip config list``'s lines (``global.find-links='/opt/wheels'``, ``:env:.cert='...'``) by key; a value
    from the environment (``:env:``) wins over the files'."""
    files: dict[str, str] = {}
    environment: dict[str, str] = {}
    for line in listing.splitlines():
        name, _, quoted = line.partition("=")
        if not quoted:
            continue
        scope, _, key = name.rpartition(".")
        (environment if scope == ":env:" else files)[key] = str(ast.literal_eval(quoted))
    return {**files, **environment}


def uv_flags(settings: dict[str, str]) -> list[str]:
    """uv's flags for pip's ``settings``."""
    flags = ["--index-strategy", "unsafe-best-match"]
    for key, flag in FLAGS.items():
        for value in dict.fromkeys(settings.get(key, "").split()):
            flags += [flag, value]
    if settings.get("no-index", "").lower() in {"1", "true", "yes", "on"}:
        flags.append("--no-index")
    return flags


def main(args: list[str]) -> int:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=False).stdout
    settings = pip_settings(listing)
    env = dict(os.environ)
    if settings.get("cert"):
        env.setdefault("SSL_CERT_FILE", settings["cert"])
    uv = Path(sys.executable).with_name("uv")
    command = [str(uv), "pip", "install", "--quiet", "--python", sys.executable, *uv_flags(settings), *args]
    return subprocess.run(command, env=env, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
