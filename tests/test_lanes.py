"""The work units of ``make test``'s lanes (the root conftest.py): every cluster test in one, each module of
``ONE_WORKER_MODULES`` in one (its costly module fixture made once), every other test on its own."""

from __future__ import annotations

import importlib.util
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
