#!/usr/bin/env bash
# Run every benchmark under tests/benchmarks/. Each prints its own figures and its ratio against a baseline
# measured in the same run. Benchmarks are not part of `make test`: timing belongs here, not in unit tests.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
for bench in tests/benchmarks/bench_*.py; do
  [[ -e $bench ]] || { echo "bench: no benchmarks found"; exit 1; }
  echo "=== $bench"
  .venv/bin/python "$bench" || { echo "bench: $bench failed" >&2; status=1; }
done
exit $status
