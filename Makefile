# Bamboo monorepo. The README's two commands: `make demo` and `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
export DS_ACCELERATOR := cpu
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions

.PHONY: setup test lint demo proto bench clean help

help:
	@echo "make setup   create .venv and install torch, deepspeed, etcd and every package (idempotent)"
	@echo "make test    setup, ruff, the import contracts (lint-imports), then pytest over every package and tests/"
	@echo "             in three xdist lanes (cluster tests one at a time; PYTEST_ARGS='-n 0' runs it in one process)"
	@echo "make demo    setup, then run the project's main job"
	@echo "make proto   regenerate the gRPC/protobuf stubs from proto/"
	@echo "make bench   run the benchmarks (slow; they print ratios against baselines measured in the same run)"

setup:
	@bash scripts/setup.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

# The packages are byte-compiled first: where PYTHONDONTWRITEBYTECODE is set (as on this project's development machines), every process
# the suite starts would otherwise compile the sources it imports again (about 0.2 CPU-s each). For the same reason
# the test modules' asserts are rewritten once (scripts/warm_assert_cache.py), not once per pytest worker.
# The tests' temporary files (tmp_path, the etcd data dirs, checkpoints, run dirs) go to one folder in memory
# (/dev/shm) where there is one: their fsyncs cost nothing there (in A/B runs of e2e and checkpoint tests, 4 to 7%
# less CPU); it is removed when the tests pass or are interrupted, and kept, with its path printed, when they fail.
test: setup lint
	@$(PY) -m compileall -q -j 0 packages > /dev/null
	@$(PY) scripts/warm_assert_cache.py
	@tmp=$$(mktemp -d /dev/shm/bamboo-test.XXXXXX 2>/dev/null || mktemp -d -t bamboo-test.XXXXXX); \
	trap 'rm -rf "$$tmp"; exit 130' INT TERM; \
	TMPDIR=$$tmp $(PY) -m pytest -n 3 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests; that is a failure" >&2; fi; \
	if [ $$rc -eq 0 ]; then rm -rf "$$tmp"; else echo "make test: the tests' temporary files are kept in $$tmp" >&2; fi; \
	exit $$rc

demo: setup
	@bash scripts/demo.sh

proto: setup
	$(PY) scripts/gen_proto.py

bench: setup
	@bash scripts/bench.sh

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache .hypothesis
