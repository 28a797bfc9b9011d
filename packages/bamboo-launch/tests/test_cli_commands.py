"""The subcommands that other packages declare (``bamboo.launch.commands`` entry points): found and listed in
order when declared, one line and status 2 when not (``run``, ``market`` and ``report`` without bamboo-bench)."""

from __future__ import annotations

import argparse
from types import ModuleType

import pytest
from bamboo.launch import cli


class _Point:
    """What :func:`importlib.metadata.entry_points` yields: a name and a ``load()``."""

    def __init__(self, name: str, module: object) -> None:
        self.name = name
        self._module = module

    def load(self) -> object:
        if isinstance(self._module, Exception):
            raise self._module
        return self._module


def _declaring(monkeypatch: pytest.MonkeyPatch, *points: _Point) -> None:
    def entry_points(group: str) -> list[_Point]:
        assert group == cli.ENTRY_POINT_GROUP
        return list(points)

    monkeypatch.setattr(cli, "entry_points", entry_points)


@pytest.mark.parametrize("argv", [["run", "--nodes", "3", "--verify"], ["run"], ["run", "--help"],
                                  ["run", "--", "train.py", "--lr", "3"],
                                  ["market", "--preemptions", "synthetic:1", "--", "sleep", "9"]])
def test_without_bamboo_bench_run_and_market_say_so_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    _declaring(monkeypatch)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"bamboo-launch: error: bamboo-launch {argv[0]} needs bamboo-bench (its emulated spot cluster), "
                   "which is not installed here: pip install 'bamboo-bench[emulated]' (or -e packages/bamboo-bench)\n")


@pytest.mark.parametrize("argv", [["report", "events.jsonl"], ["report", "--etcd", "h:1", "--job", "j", "--json"]])
def test_without_bamboo_bench_report_says_so_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    _declaring(monkeypatch)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("bamboo-launch: error: bamboo-launch report needs bamboo-bench (its report of a run's value), "
                   "which is not installed here: pip install 'bamboo-bench[value]' (or -e packages/bamboo-bench)\n")


def test_a_module_that_cannot_be_imported_reads_as_not_installed(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _declaring(monkeypatch, _Point("run", ImportError("No module named 'bamboo.bench.emulated'")))
    assert cli.main(["run", "--nodes", "3"]) == 2
    assert "bamboo-launch run needs bamboo-bench" in capsys.readouterr().err


def test_a_declared_command_is_parsed_and_run_and_listed_in_order(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    module = ModuleType("declared_run")
    ran: list[argparse.Namespace] = []

    def add_parser(subparsers: argparse._SubParsersAction) -> None:
        parser = subparsers.add_parser("run", help="a declared run")
        parser.add_argument("--nodes", type=int, default=1)
        parser.set_defaults(handler=lambda args: ran.append(args) or 0, script=[])

    module.add_parser = add_parser  # type: ignore[attr-defined]
    extra = ModuleType("declared_extra")
    extra.add_parser = lambda subparsers: subparsers.add_parser("zzz").set_defaults(  # type: ignore[attr-defined]
        handler=lambda args: 0)
    _declaring(monkeypatch, _Point("zzz", extra), _Point("run", module))
    assert cli.main(["run", "--nodes", "4", "--", "train.py"]) == 0
    assert ran[0].nodes == 4 and ran[0].script == ["train.py"]
    choices = cli.build_parser()._subparsers._group_actions[0].metavar  # type: ignore[union-attr]
    assert choices == "{agent,run,export,k8s,market,report,watch,finish,zzz}"
    capsys.readouterr()


def test_one_of_this_package_s_commands_reads_no_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bamboo-launch agent`` (every machine's start) parses without loading the declared commands' modules;
    the full parser, for ``--help`` or a declared command, still lists them all."""
    def entry_points(group: str) -> list[_Point]:
        raise AssertionError(f"read the entry points of {group}")

    monkeypatch.setattr(cli, "entry_points", entry_points)
    args = cli._parse(["agent", "--job", "j", "--etcd", "127.0.0.1:2379", "--stages", "2", "--pipelines", "1"])
    assert (args.command, args.job) == ("agent", "j")
    for name in ("export", "k8s", "watch", "finish"):
        assert list(cli.build_parser(name)._subparsers._group_actions[0].choices) == [name]  # type: ignore[union-attr]
    monkeypatch.undo()
    assert "run" in cli.build_parser("run")._subparsers._group_actions[0].choices  # type: ignore[union-attr]
