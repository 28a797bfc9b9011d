"""Render ``docs/benchmarks.md`` from the measured results in ``docs/results/*.json``.

Each result file is one benchmark's latest measured run, an object::

    {"command": "<the exact command>", "machine": "<what it ran on, and the load>", "date": "YYYY-MM-DD",
     "results": <what the benchmark printed with --json>}

The page lists every benchmark of the repository (each ``tests/benchmarks/bench_*.py``, ``bamboo-bench compare``
and ``make demo``'s run), measured or not: a benchmark without a result file says "not measured yet" with the
command that measures it. Nothing on the page is typed by hand, so ``python scripts/benchmarks_page.py`` after
saving a result file is the whole update; ``--check`` exits 1 when the committed page is not what this script
renders (``tests/test_docs.py`` runs it).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
KEYS = ("command", "machine", "date", "results")

#: The benchmarks that are commands rather than files under tests/benchmarks: name -> (what it measures, the
#: command that measures it and prints JSON).
COMMANDS = {
    "compare": ("Bamboo against checkpoint/restart (torchrun elastic agents, DeepSpeed) and on-demand, measured on "
                "one replayed trace (SkyPilot's 3-zone AWS trace, bench_churn.py's skypilot-aws, x240), each run "
                "predicted by the simulator from the profile it measured.",
                "bamboo-bench compare --preemptions SKYPILOT_AWS.csv --time-scale 240 --nodes 8 --stages 3 "
                "--pipelines 2 --duration 90 --timeout 600 --json"),
    "compare_seeds": ("The comparison on the demo's synthetic market (synthetic:0.33, x60) over three trace seeds (`--seeds 3`): each system's median and range, "
                      "each ratio taken within one seed before the median.",
                      "bamboo-bench compare --preemptions synthetic:0.33 --hours 1.45 --seed 771 --zones a,b,c "
                      "--time-scale 60 --nodes 8 --stages 4 --pipelines 2 --duration 30 --timeout 300 --seeds 3 --json"),
    "compare_gcp": ("The same comparison on a real two-zone trace: the Bamboo paper's two GCP count logs, scaled to at "
                    "most 4 nodes a zone (bench_churn.py's gcp-pair trace), x240.",
                    "bamboo-bench compare --preemptions GCP_PAIR.csv --time-scale 240 --nodes 8 --stages 3 "
                    "--pipelines 2 --duration 90 --timeout 600 --json"),
    "compare_long_run": ("The comparison on the demo's synthetic market, and its measured profiles at full scale on the paper's EC2 p3 trace "
                         "uncompressed (`long_run` of each system), with step times from a fault-free measurement one "
                         "core per stage.",
                         "bamboo-bench compare --preemptions synthetic:0.33 --hours 1.45 --seed 771 --zones a,b,c "
                         "--time-scale 60 --nodes 8 --stages 4 --pipelines 2 --duration 30 --timeout 300 "
                         "--long-run ../shared/traces/bamboo/p3-trace.csv --json"),
    "heavy_churn": ("Issue 34's acceptance: its heavy-churn command (synthetic preemptions at 0.5 per node-hour, x240, "
                    "default leases) run ten times one after the other, each checked bit for bit against a "
                    "fault-free run; one row per run.",
                    "for i in $(seq 10); do bamboo-launch run --nodes 6 --stages 3 --pipelines 2 --preemptions "
                    "synthetic:0.5 --hours 24 --seed 2 --time-scale 240 --steps 400 --verify --no-live --json; done"),
    "demo": ("The main job of `make demo`: 8 emulated spot nodes, P = 4, D = 2, synthetic preemptions, failovers "
             "and reconfigurations, checked bit for bit against a fault-free run.",
             "bamboo-launch run --nodes 8 --zones a,b,c --stages 4 --pipelines 2 --steps 500 --preemptions "
             "synthetic:0.33 --hours 1.45 --seed 771 --time-scale 60 --ttl 10 --grace 10 --timeout 420 "
             "--checkpoint-dir DIR --no-live --verify --json"),
}


class ResultError(ValueError):
    """A result file that does not follow the format; the message names the file."""


def benchmarks(root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """Every benchmark of the repository: name -> (what it measures, the command that measures it)."""
    found = {}
    for path in sorted((root / "tests" / "benchmarks").glob("bench_*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        summary = " ".join(doc.split("\n\n", 1)[0].split())
        for prefix in ("Benchmark: ", "Benchmark of ", "Benchmark for "):
            summary = summary.removeprefix(prefix)
        summary = summary[:1].upper() + summary[1:]
        text = path.read_text()
        json_flag = (" --json" if 'action="store_true", help="print only the JSON' in text
                     else " --json OUT.json" if '"--json"' in text else "")
        found[path.stem.removeprefix("bench_")] = (summary, f".venv/bin/python {path.relative_to(root)}{json_flag}")
    return {**COMMANDS, **found}


def load_results(folder: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """The result files, by benchmark name (the file's stem)."""
    loaded = {}
    for path in sorted(folder.glob("*.json")):
        try:
            document = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ResultError(f"{path}: not JSON ({error.msg}, line {error.lineno})") from None
        if not isinstance(document, dict) or set(document) != set(KEYS):
            raise ResultError(f"{path}: a result is an object with exactly the keys {list(KEYS)}")
        loaded[path.stem] = document
    return loaded


INLINE_CHARS = 60
"""A list or object in a table cell is written out when its text (numbers to 4 significant digits) fits this."""


def _short(value: Any) -> Any:
    """``value`` with every float rounded to 4 significant digits, for a cell's inline text."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, Mapping):
        return {key: _short(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_short(item) for item in value]
    return value


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Mapping | list):
        text = json.dumps(_short(value), sort_keys=True)
        return f"`{text}`" if len(text) <= INLINE_CHARS else "(see the JSON file)"
    return str(value).replace("|", "\\|").replace("\n", " ")


WIDE_COLUMNS = 12
"""A table of records with more keys than this and no more rows than :data:`FEW_ROWS` is written turned: a row
per key, a column per record (a 4-row table of 55 columns could not be read)."""
FEW_ROWS = 4


def _table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    if len(columns) > WIDE_COLUMNS and 1 <= len(rows) <= FEW_ROWS:
        first, rest = columns[0], columns[1:]  # the first key names each record (the system, the run, N)
        lines = ["| " + " | ".join([_cell(first), *(_cell(row.get(first, "")) for row in rows)]) + " |",
                 "|" + "---|" * (len(rows) + 1)]
        return lines + ["| " + " | ".join([_cell(key), *(_cell(row.get(key, "")) for row in rows)]) + " |"
                        for key in rest]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(key, "")) for key in columns) + " |" for row in rows]
    return lines


def _rows(value: Any) -> bool:
    """Whether ``value`` is a table of its own: a list of objects, or an object of two or more objects that share
    at least half of their keys (records of one kind: a row each, named by its key)."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(row, Mapping) for row in value)
    if not (isinstance(value, Mapping) and len(value) >= 2
            and all(isinstance(row, Mapping) and row for row in value.values())):
        return False
    keys = [set(row) for row in value.values()]
    return 2 * len(set.intersection(*keys)) >= len(set.union(*keys))


def _flatten(results: Mapping[str, Any], path: str, plain: dict[str, Any], tables: list[tuple[str, Any]]) -> None:
    """Split an object into its plain values, by dotted key (objects within objects are opened), and the values
    that are tables of their own (`_rows`), by dotted key, in order."""
    for key, value in results.items():
        name = f"{path}.{key}" if path else str(key)
        if _rows(value):
            tables.append((name, value))
        elif isinstance(value, Mapping) and value:
            _flatten(value, name, plain, tables)
        else:
            plain[name] = value


def render_results(results: Any) -> list[str]:
    """A benchmark's ``results`` as Markdown tables: a list of objects is one table (a row each); an object is a
    table of its plain values by dotted key (the objects within it opened), then one table per value that is a
    list of objects or an object of objects (a row each, its key first)."""
    if _rows(results) and isinstance(results, list):
        return _table(results)
    if isinstance(results, Mapping):
        plain: dict[str, Any] = {}
        tables: list[tuple[str, Any]] = []
        _flatten(results, "", plain, tables)
        lines = _table([{"key": key, "value": value} for key, value in plain.items()]) if plain else []
        for name, value in tables:
            rows = value if isinstance(value, list) else [{"": key, **row} for key, row in value.items()]
            lines += ["", f"`{name}`:", "", *_table(rows)]
        return lines
    return [f"`{json.dumps(results)}`"]


def render(root: Path = ROOT) -> str:
    """The whole page."""
    known = benchmarks(root)
    results = load_results(root / "docs" / "results")
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by scripts/benchmarks_page.py from docs/results/*.json: do not edit by hand. -->",
        "",
        "The latest measured figures of every benchmark in this repository, each with the command that measured it, "
        "the machine and the date. A benchmark prints its ratio against a baseline measured in the same run. To "
        "update a row: run the command, save what it printed with `--json` as `docs/results/NAME.json` (an object "
        "with `command`, `machine`, `date` and `results`), then run `python scripts/benchmarks_page.py`.",
        "",
        "| benchmark | what it measures | measured |",
        "|---|---|---|",
    ]
    for name, (summary, _) in known.items():
        found = results.get(name)
        when = f"{found['date']}, {found['machine']}" if found else "not measured yet"
        lines.append(f"| [{name}](#{name}) | {_cell(summary)} | {_cell(when)} |")
    for name, (summary, command) in known.items():
        found = results.get(name)
        lines += ["", f"## {name}", "", summary, ""]
        if found is None:
            lines += ["Not measured yet. The command:", "", "```", command, "```"]
            continue
        lines += [f"Measured on {found['date']}, {found['machine']}:", "", "```", found["command"], "```", "",
                  *render_results(found["results"])]
    unknown = sorted(set(results) - set(known))
    if unknown:
        raise ResultError(f"docs/results has results of no known benchmark: {unknown}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/benchmarks.md is not up to date")
    args = parser.parse_args(argv)
    try:
        page = render()
    except ResultError as error:
        print(f"benchmarks_page: error: {error}", file=sys.stderr)
        return 2
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print("benchmarks_page: docs/benchmarks.md is not what docs/results renders; run "
                  "python scripts/benchmarks_page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
