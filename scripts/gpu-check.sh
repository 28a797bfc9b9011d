#!/usr/bin/env bash
# The prepared GPU check: verify on the GPU (P = 2 and 4, D = 2, every redundancy mode, kills), the failover
# pause, eflb's overhead against none and DeepSpeed, the stash and peak GPU memory per mode, the transport's
# staging, the CUDA tests and a transformers model, printed as one table. Within 8 minutes on one H100.
#
#   scripts/gpu-check.sh             on a machine with a GPU (torch's CUDA build in .venv, or PYTHON=...)
#   scripts/gpu-check.sh --dry-run   the same steps on the CPU with the smallest sizes (make test runs it)
#   scripts/gpu-check.sh --json OUT  also write the rows as JSON
#
# Exit status: 0 when every goal with a verdict is met, 1 when one is not, 2 when there is no GPU to check.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
exec "$PYTHON" scripts/gpu_check.py "$@"
