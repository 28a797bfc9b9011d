"""The documents in docs/ say what the code does: the timeouts table matches every package's timeouts
module, the failures said to be survived name tests that exist, the README links the documents, the
benchmarks page is what the measured results render, and no README names a commit."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAILURE_MODEL = ROOT / "docs" / "failure-model.md"
TIMEOUT_MODULES = ("bamboo.membership.timeouts", "bamboo.schedule.timeouts", "bamboo.rc.timeouts", "bamboo.launch.timeouts",
                   "bamboo.bench.emulated.timeouts")
ROW = re.compile(r"^\| `(bamboo\.[a-z]+(?:\.[a-z]+)?\.timeouts\.[A-Z0-9_]+)` \| `([0-9.]+) s` \| (.*?) \| (.+) \|$")


def _table() -> dict[str, float]:
    rows: dict[str, float] = {}
    for line in FAILURE_MODEL.read_text().splitlines():
        match = ROW.match(line)
        if match:
            name, default, _flag, meaning = match.groups()
            assert name not in rows, f"{name} is in the table twice"
            assert meaning.strip(), f"{name}: say what happens when it fires"
            rows[name] = float(default)
    return rows


def _constants() -> dict[str, float]:
    constants = {}
    for module_name in TIMEOUT_MODULES:
        module = importlib.import_module(module_name)
        for name in dir(module):
            if name.endswith("_S") and name.isupper():
                constants[f"{module_name}.{name}"] = float(getattr(module, name))
    return constants


def test_the_timeouts_table_has_every_constant_with_its_default() -> None:
    table, constants = _table(), _constants()
    assert len(table) > 40, "the timeouts table was not found in docs/failure-model.md"
    missing = sorted(set(constants) - set(table))
    assert not missing, f"timeouts defined in code but not in docs/failure-model.md: {missing}"
    unknown = sorted(set(table) - set(constants))
    assert not unknown, f"timeouts in docs/failure-model.md that the code does not define: {unknown}"
    wrong = {name: (table[name], constants[name]) for name in table if table[name] != pytest.approx(constants[name])}
    assert not wrong, f"defaults that differ (table, code): {wrong}"


def test_every_survived_failure_names_tests_that_exist() -> None:
    text = FAILURE_MODEL.read_text()
    section = text.split("## What Bamboo survives", 1)[1].split("## What Bamboo does not survive", 1)[0]
    paths = re.findall(r"`((?:packages|tests)/[^`:]+\.py)(?:::(\w+))?`", section)
    assert len(paths) >= 10
    for path, test in paths:
        file = ROOT / path
        assert file.is_file(), f"docs/failure-model.md names {path}, which does not exist"
        if test:
            assert f"def {test}(" in file.read_text(), f"{path} has no test {test}"


def test_the_readme_links_the_design_documents_in_the_repository() -> None:
    readme = (ROOT / "README.md").read_text()
    for document in ("docs/failure-model.md", "docs/architecture.md"):
        assert f"({document})" in readme, f"README.md does not link {document}"
        assert (ROOT / document).is_file()
    assert "../shared" not in readme.split("## Two commands", 1)[0], "the README must not send readers outside the repo"


def _benchmarks_page() -> object:
    spec = importlib.util.spec_from_file_location("benchmarks_page", ROOT / "scripts" / "benchmarks_page.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_benchmarks_page_is_what_the_results_render() -> None:
    """docs/benchmarks.md is generated from docs/results/*.json (scripts/benchmarks_page.py): no hand-edited
    figure, and no result file left out of the page."""
    page = _benchmarks_page()
    assert (ROOT / "docs" / "benchmarks.md").read_text() == page.render(), (  # type: ignore[attr-defined]
        "docs/benchmarks.md is out of date: run python scripts/benchmarks_page.py")


def test_a_result_file_becomes_a_table_with_its_command(tmp_path: Path) -> None:
    page = _benchmarks_page()
    (tmp_path / "tests" / "benchmarks").mkdir(parents=True)
    (tmp_path / "tests" / "benchmarks" / "bench_toy.py").write_text('"""Benchmark: a toy, against a baseline."""\n')
    (tmp_path / "docs" / "results").mkdir(parents=True)
    result = {"command": "python toy.py --json", "machine": "2 cores, load 0.4", "date": "2026-11-28",
              "results": [{"system": "bamboo", "throughput": 12.34567}, {"system": "baseline", "throughput": 3.0}]}
    (tmp_path / "docs" / "results" / "toy.json").write_text(json.dumps(result))
    text = page.render(tmp_path)  # type: ignore[attr-defined]
    assert "| [toy](#toy) | A toy, against a baseline. | 2026-11-28, 2 cores, load 0.4 |" in text
    assert "python toy.py --json" in text and "| bamboo | 12.35 |" in text and "| baseline | 3 |" in text
    assert "| [demo](#demo) |" in text and "not measured yet" in text
    (tmp_path / "docs" / "results" / "toy.json").write_text(json.dumps({"command": "x"}))
    with pytest.raises(ValueError, match="exactly the keys"):
        page.render(tmp_path)  # type: ignore[attr-defined]


def test_nested_results_show_every_figure_by_dotted_key_and_records_of_one_kind_as_rows() -> None:
    page = _benchmarks_page()
    results = {"goal_s": 36, "training": {"agents": {"count": 8, "pct": 0.4625}, "launcher_s": 58.2},
               "variants": {"none": {"ms": 490.9, "kind_ms": {"F": 153.1}, "pct": 0},
                            "lflb": {"ms": 515.7, "pct": 5.044, "extra": True}},
               "parts": {"link": {"latency_ms": 0.06}, "costs": {"rate": 7.06}},
               "samples": [float(k) + 0.123456 for k in range(30)]}
    lines = page.render_results(results)  # type: ignore[attr-defined]
    assert "| training.agents.count | 8 |" in lines and "| training.launcher_s | 58.2 |" in lines
    assert "| parts.link.latency_ms | 0.06 |" in lines  # objects of different kinds: opened, not rows
    assert "| samples | (see the JSON file) |" in lines  # too long to write out
    at = lines.index("`variants`:")
    assert lines[at + 2:at + 6] == ["|  | ms | kind_ms | pct | extra |", "|---|---|---|---|---|",
                                    '| none | 490.9 | `{"F": 153.1}` | 0 |  |', "| lflb | 515.7 |  | 5.044 | True |"]


def test_a_few_records_of_many_keys_are_written_turned() -> None:
    page = _benchmarks_page()
    wide = [{"agents": n, **{f"key{k}": n * k for k in range(13)}} for n in (64, 1000)]
    lines = page.render_results(wide)  # type: ignore[attr-defined]
    assert lines[:3] == ["| agents | 64 | 1000 |", "|---|---|---|", "| key0 | 0 | 0 |"]
    assert lines[-1] == "| key12 | 768 | 12000 |" and len(lines) == 2 + 13
    narrow = page.render_results(wide[:1] * 5)  # type: ignore[attr-defined]
    assert narrow[0].startswith("| agents | key0 | key1 |") and len(narrow) == 2 + 5


def test_no_readme_names_a_commit_and_the_front_door_is_short() -> None:
    readmes = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
    for path in readmes:
        hashes = re.findall(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w-])", path.read_text())
        commits = [word for word in hashes if re.search(r"[a-f]", word) and re.search(r"[0-9]", word)]
        assert not commits, f"{path.relative_to(ROOT)} names commits {commits}: say what, not when"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 120, "README.md is a front door: 120 lines at most"
