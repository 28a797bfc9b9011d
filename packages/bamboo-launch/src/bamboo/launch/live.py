"""The live progress view of a run, built from its event log as the log grows.

Three parts, so that the logic is tested without a terminal or a clock:

- :class:`EventFollower` reads the records appended to an event log since its last
  :meth:`~EventFollower.poll`, and only whole lines (a record being written is read next time);
- :class:`LiveState` folds records into what the view shows: step, loss, samples/s over the last
  steps, nodes active, on standby and joining, counts of preemptions, failovers,
  reconfigurations, checkpoints and restores, and the last events;
- :func:`render_live` turns a state into a rich renderable; ``bamboo-launch watch`` refreshes it;
- :class:`LiveView` keeps one on a console and draws it again only when a record arrived (what it shows
  depends on the records alone), at most once a second, so that watching a run costs almost nothing between
  steps, and little when a job steps many times a second.

*Joining* nodes are nodes that have joined (and not been preempted) but are neither at work in
the last step nor on standby after the last reconfiguration: they wait for the next one. Before the first
reconfiguration the first layout's standby nodes are counted from the nodes alive at the first step: those of
them, up to ``target_nodes``, that do not train (no record names the first layout's standby list; a node that
joined after the first step waits for a reconfiguration).
"""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
from bamboo.launch import timeouts
from bamboo.launch.events import (
    Checkpoint,
    Event,
    EventLogError,
    Failover,
    Join,
    Preemption,
    Reconfiguration,
    RedundancyChoice,
    Restore,
    RunEnd,
    RunStart,
    Startup,
    Step,
    TimeAccount,
    WorkerPhase,
    event_from_dict,
)
from bamboo.launch.json_types import JSONObject
from bamboo.launch.redundancy import describe_choice

if TYPE_CHECKING:
    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

__all__ = ["DEFAULT_WINDOW", "EventFollower", "LiveState", "LiveView", "ProgressLines", "describe_event", "render_live"]

DEFAULT_WINDOW = 10
"""How many recent steps the live view's samples/s figure averages over (``watch --window``)."""


class EventFollower:
    """Reads an event log incrementally: each :meth:`poll` returns the whole records added since.

    A missing file reads as empty (the run has not started writing yet). A malformed record
    raises :class:`EventLogError` naming the file and line.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offset = 0
        self._line = 0
        self._partial = b""

    def poll(self) -> list[Event]:
        """The records completed since the last call, in file order."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        events = []
        for raw in lines:
            self._line += 1
            if not raw.strip():
                continue
            try:
                events.append(event_from_dict(json.loads(raw)))
            except json.JSONDecodeError as error:
                raise EventLogError(f"{self.path}:{self._line}: not valid JSON ({error.msg})") from None
            except (ValueError, TypeError) as error:
                raise EventLogError(f"{self.path}:{self._line}: {error}") from None
        return events


def describe_event(event: Event) -> str:
    """A short human line for one record (steps excluded: they fill the header instead)."""
    if isinstance(event, Join):
        return f"{event.t:8.1f}s  join          {event.node} in {event.zone}"
    if isinstance(event, Preemption):
        notice = f", {event.notice_s:.1f}s notice" if event.notice_s > 0 else ""
        reason = f" ({event.reason})" if event.reason else ""
        return f"{event.t:8.1f}s  preemption    {event.node} in {event.zone}{notice}{reason}"
    if isinstance(event, Failover):
        return f"{event.t:8.1f}s  failover      {event.victim} -> {event.shadow} (stage {event.stage}), pause {event.pause_s:.2f}s"
    if isinstance(event, Reconfiguration):
        return (
            f"{event.t:8.1f}s  reconfigure   {event.reason}: D={event.pipelines} P={event.stages}, "
            f"{event.standby} standby, {event.bytes_moved / 2**20:.1f} MiB; "
            f"{'prepared while training, ' if event.prepared else ''}pause {_pause(event)}"
        )
    if isinstance(event, Restore):
        where = {"memory": "a peer's memory", "disk": "disk", "initial": "the initial state (nothing was left)"}.get(
            event.source or "disk", event.source or "disk")
        return (
            f"{event.t:8.1f}s  restore       step {event.step} from {where} (every live copy of stage "
            f"{event.lost_stages} lost), {event.discarded_steps} steps trained again"
        )
    if isinstance(event, Startup):
        return f"{event.t:8.1f}s  started       {event.node}: {_startup(event)}"
    if isinstance(event, Checkpoint):
        return f"{event.t:8.1f}s  checkpoint    step {event.step}, {event.bytes / 2**20:.1f} MiB in {event.duration_s:.2f}s"
    if isinstance(event, RunStart):
        return (
            f"{event.t:8.1f}s  start         job {event.job}: {event.target_nodes} nodes, "
            f"P={event.stages}, D={event.pipelines}"
        )
    if isinstance(event, RunEnd):
        return f"{event.t:8.1f}s  end           after {event.steps} steps"
    if isinstance(event, RedundancyChoice):
        return f"{event.t:8.1f}s  redundancy    {describe_choice(event)}"
    if isinstance(event, WorkerPhase):
        about = "" if event.generation is None else f", generation {event.generation}"
        return f"{event.t:8.1f}s  phase         {event.node}: {event.previous} -> {event.phase} ({event.cause}{about})"
    return f"{event.t:8.1f}s  step          {event.step}"


def _pause(event: Reconfiguration) -> str:
    """``0.52s (nodes 0.00, decide 0.01, barrier 0.10, transfers 0.20, groups 0.00, first step 0.21)``, or the
    total alone for a record written without its parts."""
    if event.barrier_s is None:
        return f"{event.duration_s:.2f}s"
    return (f"{event.duration_s:.2f}s (nodes {event.nodes_s or 0:.2f}, decide {event.decide_s or 0:.2f}, barrier "
            f"{event.barrier_s:.2f}, transfers "
            f"{event.transfers_s or 0:.2f}, groups {event.group_builds_s or 0:.2f}, first step "
            f"{event.first_step_s or 0:.2f})")


def _startup(event: Startup) -> str:
    """The phases of a worker's start that it went through, in order."""
    phases = (("process", event.process_s), ("imports", event.imports_s), ("model", event.model_s),
              ("waiting", event.wait_s), ("layers", event.model_build_s), ("groups", event.group_build_s),
              ("first step", event.first_step_s))
    return ", ".join(f"{name} {value:.2f}s" for name, value in phases if value is not None)


class LiveState:
    """What the live view shows, folded from records with :meth:`apply`.

    ``window`` is how many recent steps the samples/s figure averages over; ``history`` how many
    recent events (other than steps) are kept.
    """

    def __init__(self, window: int = DEFAULT_WINDOW, history: int = 8) -> None:
        if window < 1 or history < 1:
            raise ValueError(f"window and history must be >= 1, got {window} and {history}")
        self.job = ""
        self.target_nodes = 0
        self.step: int | None = None
        self.loss: float | None = None
        self.nodes_active = 0
        self._standby: int | None = None  # after the last reconfiguration; None before the first one
        self._first_nodes: frozenset[str] = frozenset()  # the nodes alive at the first step
        self.alive: dict[str, str] = {}
        self.preemptions = 0
        self.failovers = 0
        self.reconfigurations = 0
        self.checkpoints = 0
        self.restores = 0
        self.finished = False
        self.now = 0.0
        self._steps: collections.deque[Step] = collections.deque(maxlen=window)
        self.time = TimeAccount()
        self.recent: collections.deque[str] = collections.deque(maxlen=history)
        self._choices: dict[int, RedundancyChoice] = {}
        self._generation: int | None = None
        self.phases: dict[str, str] = {}
        """Each alive node's worker phase (``phase`` records: they set this, not the recent lines)."""

    def apply(self, event: Event) -> None:
        """Fold one record into the state."""
        self.now = max(self.now, event.t)
        self.time.apply(event)
        if isinstance(event, Step):
            if self.step is None:
                self._first_nodes = frozenset(self.alive)
            self.step, self.loss, self.nodes_active = event.step, event.loss, event.nodes_active
            self._steps.append(event)
            self._generation = event.generation if event.generation is not None else self._generation
            return
        if isinstance(event, WorkerPhase):
            self.phases[event.node] = event.phase
            return
        self.recent.append(describe_event(event))
        if isinstance(event, RunStart):
            self.job, self.target_nodes = event.job, event.target_nodes
        elif isinstance(event, Join):
            self.alive[event.node] = event.zone
        elif isinstance(event, Preemption):
            self.alive.pop(event.node, None)
            self.phases.pop(event.node, None)
            self.preemptions += 1
        elif isinstance(event, Failover):
            self.failovers += 1
        elif isinstance(event, Reconfiguration):
            self.reconfigurations += 1
            self._standby = event.standby
        elif isinstance(event, Checkpoint):
            self.checkpoints += 1
        elif isinstance(event, Restore):
            self.restores += 1
        elif isinstance(event, RunEnd):
            self.finished = True
        elif isinstance(event, RedundancyChoice):
            self._choices[event.generation] = event

    def apply_all(self, events: Iterable[Event]) -> None:
        """Fold several records in order."""
        for event in events:
            self.apply(event)

    @property
    def samples_per_second(self) -> float | None:
        """Samples over the time the last ``window`` steps took (None before two steps)."""
        if not self._steps:
            return None
        first, last = self._steps[0], self._steps[-1]
        begin = first.t - first.duration_s
        if last.t <= begin:
            return None
        return sum(step.samples for step in self._steps) / (last.t - begin)

    @property
    def redundancy(self) -> RedundancyChoice | None:
        """``--redundancy auto``'s choice in force: that of the newest step's generation, else the newest."""
        if self._generation in self._choices:
            return self._choices[self._generation]
        return self._choices[max(self._choices)] if self._choices else None

    @property
    def phase_counts(self) -> dict[str, int]:
        """How many alive workers are in each phase, most first (``training``: 6, ``standby``: 2, ...)."""
        counts = collections.Counter(self.phases.values())
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    @property
    def standby(self) -> int:
        """Alive nodes on standby: after the last reconfiguration, as it left them; before it, the first layout's
        (see the module docstring)."""
        if self._standby is not None:
            return self._standby
        first = sum(1 for node in self.alive if node in self._first_nodes)
        return max(0, min(first, self.target_nodes) - self.nodes_active)

    @property
    def joining(self) -> int:
        """Alive nodes neither at work nor on standby."""
        return max(0, len(self.alive) - self.nodes_active - self.standby)

    def progress_line(self) -> str:
        """One line for a terminal without the live view: step, loss, samples/s, nodes."""
        rate = self.samples_per_second
        return (f"step {self.step if self.step is not None else '-'}  "
                f"loss {'-' if self.loss is None else f'{self.loss:.4f}'}  "
                f"samples/s {'-' if rate is None else f'{rate:.1f}'} (last {self._steps.maxlen} steps)  "
                f"nodes {self.nodes_active} active, {self.standby} standby, {self.joining} joining")

    def summary(self) -> JSONObject:
        """The state as a flat dict (for ``watch --once --json`` and tests)."""
        return {
            "job": self.job,
            "t": self.now,
            "step": self.step,
            "loss": self.loss,
            "samples_per_second": self.samples_per_second,
            "nodes_alive": len(self.alive),
            "nodes_active": self.nodes_active,
            "standby": self.standby,
            "joining": self.joining,
            "preemptions": self.preemptions,
            "failovers": self.failovers,
            "reconfigurations": self.reconfigurations,
            "checkpoints": self.checkpoints,
            "restores": self.restores,
            "redundancy": None if self.redundancy is None else self.redundancy.mode,
            "redundancy_reason": None if self.redundancy is None else describe_choice(self.redundancy),
            "worker_phases": self.phase_counts,
            **self.time.summary(),
            "finished": self.finished,
            "recent": list(self.recent),
        }


@attrs.define
class ProgressLines:
    """``--no-live``'s progress: a :meth:`LiveState.progress_line` each time the step crosses a multiple of ``every``."""

    every: int = attrs.field(validator=attrs.validators.gt(0))
    last: int | None = attrs.field(default=None, init=False)
    """The step of the last line given."""

    def line(self, state: LiveState) -> str | None:
        """The line to print now, or None (no step yet, or still within the same ``every`` steps)."""
        if state.step is None or (self.last is not None and state.step // self.every == self.last // self.every):
            return None
        self.last = state.step
        return state.progress_line()


_Cell = tuple[tuple[str, str], ...]
"""One cell of the live view's header: its parts, each (text, rich style; "" for none)."""


def _cell(*parts: str) -> _Cell:
    """A header cell from alternating label and value texts: labels bold, values plain."""
    return tuple((text, "bold" if i % 2 == 0 else "") for i, text in enumerate(parts) if text)


def _header_lines(rows: list[list[_Cell]], gap: int = 3) -> list[Text]:
    """``rows`` as lines whose columns line up, each as wide as its widest cell and ``gap`` spaces apart.

    Built by hand, not as a rich table: measuring a table's columns was most of a redraw's cost (about 15 ms
    of a 22 ms redraw, once a second for as long as a run lasts)."""
    from rich.text import Text

    def width(cell: _Cell) -> int:
        return sum(len(text) for text, _ in cell)

    widths: list[int] = []  # of each column but a row's last, which is not padded
    for row in rows:
        for column, cell in enumerate(row[:-1]):
            if column == len(widths):
                widths.append(width(cell))
            else:
                widths[column] = max(widths[column], width(cell))
    lines = []
    for row in rows:
        line = Text()
        for column, cell in enumerate(row):
            for text, style in cell:
                line.append(text, style or None)
            if column < len(row) - 1:
                line.append(" " * (widths[column] - width(cell) + gap))
        lines.append(line)
    return lines


def render_live(state: LiveState) -> Panel:
    """A rich renderable of ``state``: a header (columns of labelled figures) and the last events."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    def show(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    rows: list[list[_Cell]] = [
        [_cell("step", f" {state.step if state.step is not None else '-'}"), _cell("loss", f" {show(state.loss, 4)}"),
         _cell("samples/s", f" {show(state.samples_per_second, 2)}"), _cell("t", f" {state.now:.1f}s")],
        [_cell("active", f" {state.nodes_active}"), _cell("standby", f" {state.standby}"),
         _cell("joining", f" {state.joining}"),
         _cell("alive", f" {len(state.alive)}" + (f"/{state.target_nodes}" if state.target_nodes else ""))],
        [_cell("preemptions", f" {state.preemptions}"), _cell("failovers", f" {state.failovers}"),
         _cell("reconfigurations", f" {state.reconfigurations}"),
         _cell("checkpoints", f" {state.checkpoints}" + (f" ({state.restores} restored)" if state.restores else ""))],
    ]
    time = state.time
    share = "-" if time.step_share is None else f"{100 * time.step_share:.1f}%"
    p50, most = time.pause_p50_s, time.pause_max_s
    rows.append([
        _cell("in steps", f" {share}"), _cell("start-up", f" {time.startup_s:.1f}s"),
        _cell("failovers", f" {time.failover_s:.2f}s"),
        _cell("reconfig", f" {time.reconfiguration_s:.2f}s" + (" " if time.restore_s else ""),
              *(("restore", f" {time.restore_s:.2f}s") if time.restore_s else ())),
    ])
    if p50 is not None and most is not None:
        parts = time.parts_s
        rows.append([
            _cell("pause p50", f" {p50:.2f}s ", "max", f" {most:.2f}s"),
            _cell("prepared", f" {time.prepared}/{len(time.pauses)}"),
            _cell("nodes", f" {parts['nodes_s']:.2f}s ", "decide", f" {parts['decide_s']:.2f}s ", "barrier",
                  f" {parts['barrier_s']:.2f}s"),
            _cell("transfers", f" {parts['transfers_s']:.2f}s ", "groups", f" {parts['group_builds_s']:.2f}s ",
                  "first step", f" {parts['first_step_s']:.2f}s"),
        ])
    if state.redundancy is not None:
        choice = state.redundancy
        rows.append([_cell("redundancy", f" {choice.mode} (auto)"),
                     _cell("", f"{choice.preemptions_per_node_hour:g} preemptions/node-h"),
                     _cell("", f"step {choice.step_s:.3f}s (none)"),
                     _cell("", "lost/h " + ", ".join(f"{mode} {lost:.0f}s"
                                                     for mode, lost in choice.lost_s_per_hour.items()))])
    if state.phases:
        rows.append([_cell("workers", " " + ", ".join(f"{count} {phase}" for phase, count in state.phase_counts.items()))])
    recent = Text("\n".join(state.recent) if state.recent else "(no events yet)")
    title = "bamboo" + (f" {state.job}" if state.job else "") + (" (finished)" if state.finished else "")
    return Panel(Group(*_header_lines(rows), Text(), recent), title=title, expand=False)


class LiveView:
    """The live view of the records ``poll`` returns (an :class:`EventFollower`'s), on ``console``: a context
    manager; each :meth:`update` folds the new records in, and redraws only when there were some and the last
    redraw is ``redraw_s`` (:data:`timeouts.LIVE_REDRAW_S`) old on ``clock``; records folded in meanwhile are
    drawn at the next update after that, or when the view closes. ``state``: the state to fold into (a fresh
    :class:`LiveState` by default)."""

    def __init__(self, poll: Callable[[], list[Event]], console: Console, *, state: LiveState | None = None,
                 redraw_s: float = timeouts.LIVE_REDRAW_S, clock: Callable[[], float] = time.monotonic) -> None:
        from rich.live import Live

        self.state = LiveState() if state is None else state
        self.draws = 0
        """How many times the view was drawn (the first draw, when the view opens, included)."""
        self._poll = poll
        self._redraw_s = redraw_s
        self._clock = clock
        self._drawn_at = clock()
        self._undrawn = False
        self._live = Live(render_live(self.state), console=console, auto_refresh=False)

    def __enter__(self) -> LiveView:
        self._live.__enter__()
        self.draws += 1
        return self

    def __exit__(self, *exc: object) -> None:
        if self._undrawn:
            self._draw()
        self._live.__exit__(*exc)

    def update(self) -> bool:
        """Fold in the records since the last call; True when there were any (drawn now, or at a later update)."""
        events = self._poll()
        if events:
            self.state.apply_all(events)
            self._undrawn = True
        if self._undrawn and self._clock() - self._drawn_at >= self._redraw_s:
            self._draw()
        return bool(events)

    def _draw(self) -> None:
        self._live.update(render_live(self.state), refresh=True)
        self._drawn_at = self._clock()
        self._undrawn = False
        self.draws += 1
