"""The documents in docs/ say what the code does: the timeouts table matches every package's timeouts
module, the failures said to be survived name tests that exist, and the README links the documents."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAILURE_MODEL = ROOT / "docs" / "failure-model.md"
TIMEOUT_MODULES = ("bamboo.membership.timeouts", "bamboo.rc.timeouts", "bamboo.launch.timeouts")
ROW = re.compile(r"^\| `(bamboo\.[a-z]+\.timeouts\.[A-Z0-9_]+)` \| `([0-9.]+) s` \| (.*?) \| (.+) \|$")


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
