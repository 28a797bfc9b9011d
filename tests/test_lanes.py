"""The work units of ``make test``'s lanes (the root conftest.py): every cluster test in one, each module of
``ONE_WORKER_MODULES`` in one (its costly module fixture made once), every other test on its own."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _root_conftest() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bamboo_root_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cluster_tests_share_one_unit_and_a_shared_fixture_module_is_one_unit() -> None:
    lanes = _root_conftest()
    assert lanes.lane_scope("tests/e2e/test_run_e2e.py::test_a") == "clusters"
    assert lanes.lane_scope("tests/hosts/test_netns.py::test_b[x]") == "clusters"
    packaging = [lanes.lane_scope(f"tests/test_packaging.py::test_wheel_metadata[{part}]") for part in ("rc", "bench")]
    assert packaging == ["tests/test_packaging.py", "tests/test_packaging.py"]
    short = "packages/bamboo-schedule/tests/test_bound.py::test_c"
    assert lanes.lane_scope(short) == short
    # a background process test runs outside the cluster lane, on its own
    compare = "tests/e2e/test_compare_e2e.py::test_small_compare_records_and_profile_round_trip"
    assert lanes.lane_scope(compare) == compare


def test_every_one_worker_module_exists() -> None:
    lanes = _root_conftest()
    assert [path for path in lanes.ONE_WORKER_MODULES if not (ROOT / path).is_file()] == []


def test_the_warmed_assert_cache_is_what_pytest_reads(tmp_path: Path) -> None:
    """``scripts/warm_assert_cache.py`` writes the rewritten test modules where pytest looks for them: a pytest
    that may not write bytecode reads them (its debug trace says so) and still explains a failed assert."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_sample.py").write_text("def test_sum() -> None:\n    total = 1 + 1\n    assert total == 3\n")
    (tmp_path / "notes.py").write_text("assert True\n")  # not a test module: left alone
    warm = subprocess.run([sys.executable, str(ROOT / "scripts" / "warm_assert_cache.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=True)
    assert "rewrote the asserts of 1 of 1 test files" in warm.stdout, warm.stdout
    cached = list((tests / "__pycache__").glob("test_sample.*-pytest-*.pyc"))
    assert len(cached) == 1 and not (tmp_path / "__pycache__").exists()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DEBUG": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                           str(tests / "test_sample.py")], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "found cached rewritten pyc" in done.stdout + done.stderr
    assert "assert 2 == 3" in done.stdout  # the rewritten assert explains itself
