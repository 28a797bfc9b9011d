#!/usr/bin/env bash
# Idempotent set-up of the development environment:
#   1. .venv (Python 3.11, the CPU torch wheel is built for it),
#   2. torch==2.13.0 first (an unpinned torch would pull a multi-GB CUDA build),
#   3. deepspeed==0.19.8 built for CPU, without build isolation (its setup.py imports torch),
#   4. every package editable with its dev extras,
#   5. the Debian etcd-server when no etcd binary is found.
# Steps 2 to 4 install with uv where it can be installed into .venv (the same packages as pip, in about half the
# time), from where pip would install (scripts/uv_install.py reads pip's configuration); a step that uv cannot do
# is done again by pip.
# A second run on a set-up machine only hashes a few files and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PY=$VENV/bin/python
STAMP=$VENV/.bamboo-setup
PACKAGES=(schedule reconfig bench membership rc launch)

want=$(cat scripts/setup.sh pyproject.toml packages/*/pyproject.toml | sha256sum | cut -c1-16)
if [[ -x $PY && -f $STAMP && "$(cat "$STAMP")" == "$want" ]]; then
  echo "setup: .venv is up to date"
else
  if [[ ! -x $PY ]]; then
    base=$(command -v python3.11 || command -v python3)
    echo "setup: creating $VENV with $base"
    "$base" -m venv "$VENV"
  fi
  export DS_ACCELERATOR=cpu DS_BUILD_OPS=0
  echo "setup: pip, setuptools, wheel, uv"
  # install ARGS...: with uv where it runs, else (or where it fails) with pip.
  install() {
    if [[ -x $VENV/bin/uv ]]; then
      if "$PY" scripts/uv_install.py "$@"; then
        return 0
      fi
      echo "setup: uv could not install $*; pip tries" >&2
    fi
    "$PY" -m pip install -q --no-compile "$@"
  }
  if ! "$PY" -m pip install -q --timeout 15 --retries 1 uv; then  # an unreachable index costs seconds, not minutes
    echo "setup: uv could not be installed; pip installs everything" >&2
  fi
  install --upgrade pip setuptools wheel
  # pip byte-compiles what it installs on one core; here nothing is compiled as it is installed (uv never does, pip
  # runs with --no-compile) and the sources are compiled on every core: torch's in the background while the rest
  # is installed, the rest at the end. The bytecode matters: where PYTHONDONTWRITEBYTECODE is set, a module without
  # it is compiled again in every process.
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "setup: torch==2.13.0 (CPU wheel)"
  install 'torch==2.13.0'
  nice "$PY" -m compileall -q -j 0 "$SITE/torch" > /dev/null 2>&1 & torch_compile=$!
  if ! "$PY" -c 'import importlib.metadata as m; assert m.version("deepspeed") == "0.19.8"' 2>/dev/null; then
    echo "setup: deepspeed==0.19.8 (built from its sdist)"
    install --no-build-isolation 'deepspeed==0.19.8'
  fi
  echo "setup: the six bamboo packages, editable, with dev extras"
  args=()
  for p in "${PACKAGES[@]}"; do args+=(-e "packages/bamboo-$p[dev]"); done
  args+=(-e "packages/bamboo-bench[dev,measured,emulated,value]")  # bamboo-bench's layers above bamboo-launch
  # setuptools' deprecation notices about our pyproject files flood the terminal: keep them in a log,
  # shown only when the install fails.
  if ! install --no-build-isolation --config-settings editable_mode=compat "${args[@]}" \
      > "$VENV/setup-packages.log" 2>&1; then
    cat "$VENV/setup-packages.log" >&2
    echo "setup: installing the packages failed (log: $VENV/setup-packages.log)" >&2
    exit 1
  fi
  echo "setup: byte-compiling the installed packages"
  wait "$torch_compile" || true  # a file that does not compile is compiled (and fails) where it is imported
  # Not the ~550 model folders of transformers that nothing here imports (2,800 of its 2,900 files), nor pandas,
  # which only Hugging Face `datasets` imports (bamboo-rc's TokenDataset tests, once per test process): a third of
  # the 45 s this step took on 2 cores. Nor the libraries' own test suites (3,100 files in `tests` folders, most of
  # them sympy's, scipy's, networkx's and numpy's: those four compiled in 8.1 s with them, 4.8 s without). A module
  # imported anyway is compiled in memory by the process importing it.
  unused='/torch/|/transformers/models/(?!(auto|bert|gpt2|llama)/)|/pandas/|/tests/'
  "$PY" -m compileall -q -j 0 -x "$unused" "$SITE" > /dev/null 2>&1 || true
  echo "$want" > "$STAMP"
fi

if ! command -v etcd >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]]; then
    echo "setup: installing Debian etcd-server"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q etcd-server >/dev/null
  else
    echo "setup: no etcd binary found. Install it with:" >&2
    echo "    sudo apt-get update && sudo apt-get install -y etcd-server" >&2
    exit 1
  fi
fi
