"""The control plane's own cost: CPU per hour of training of each agent, each waiting worker, the live view.

Run: `.venv/bin/python tests/benchmarks/bench_control_cost.py` (`--help` for the flags; `--json` for JSON). Not
collected by pytest. The goal: each below 1% of one core (36 CPU-s per hour), and a worker that waits for a
role never competes with the ones that train.

- **Agents during training** (`--train-nodes`, 8): `bamboo-launch run --nodes 8 --stages 2 --pipelines 2` (the
  built-in example, real workers); once it trains, the CPU of every process over `--window-s`: each agent, each
  training worker, each warm standby worker (not in the layout: it waits for a role), the launcher (`--no-live`).
- **Idle agents** (`--idle-nodes`, 64): as many real `bamboo-launch agent` processes on one embedded etcd, whose
  worker is a script that only sleeps (so the agents' own cost is what is measured: lease refreshes, watches,
  the elected coordinator, the supervisor); once the first layout is written, their CPU over `--window-s`.
- **The live view**: the loop `bamboo-launch run` draws its live view with (`LiveState`, `render_live`, a rich
  `Live` at `LIVE_REFRESH_S`, to a terminal that discards its output), following an event log that gains one
  step record a second, in a process of its own; its CPU over `--window-s`.
- **Step time of redundancy `none`** with and without its agents: the steady measurement's P = 2 `none` training (two
  forked stage processes, TCPStore, no etcd), alone, then with two idle agents (as above) on the same machine,
  interleaved `--repeats` times; the ratio is the agents' cost to training.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _bench_common import Log, wait_for
from _scale_etcd import process_cpu_s
from bamboo.launch.spec import JobSpec
from bamboo.membership import EmbeddedEtcd, EtcdKV, EtcdOptions, MembershipStore

GOAL_CPU_S_PER_HOUR = 36.0
LAYER = {"param_bytes": 4_000_000, "optimizer_bytes": 8_000_000, "compute_cost": 1.0}
SLEEPER = "import time\nwhile True:\n    time.sleep(3600)\n"


def _children() -> dict[int, tuple[int, str]]:
    """Every process: pid -> (parent pid, command line)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        table[int(entry)] = (int(stat[1]), cmdline)
    return table


def _descendants(root: int) -> dict[int, str]:
    table = _children()
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cmdline) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = cmdline
                frontier.append(pid)
    return found


def _cpu_over(pids: list[int], window_s: float) -> dict[int, float]:
    """CPU seconds per hour of each of ``pids`` over ``window_s`` seconds (processes that ended are left out)."""
    before = {}
    for pid in pids:
        try:
            before[pid] = process_cpu_s(pid)
        except OSError:
            continue
    started = time.monotonic()
    time.sleep(window_s)
    seconds = time.monotonic() - started
    rates = {}
    for pid, cpu in before.items():
        try:
            rates[pid] = (process_cpu_s(pid) - cpu) / seconds * 3600.0
        except OSError:
            continue
    return rates


def _summary(rates: list[float]) -> dict[str, Any]:
    if not rates:
        return {"count": 0}
    return {"count": len(rates), "mean_cpu_s_per_hour": statistics.mean(rates),
            "max_cpu_s_per_hour": max(rates), "mean_pct_of_a_core": statistics.mean(rates) / 36.0}


def _flag(cmdline: str, flag: str) -> str | None:
    parts = cmdline.split()
    return parts[parts.index(flag) + 1] if flag in parts and parts.index(flag) + 1 < len(parts) else None


# -- agents during training ---------------------------------------------------------------------------


def training(args: argparse.Namespace, say: Log) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-cost-") as folder:
        events = Path(folder, "events.jsonl")
        command = [sys.executable, "-m", "bamboo.launch", "run", "--nodes", str(args.train_nodes), "--stages", "2",
                   "--pipelines", "2", "--steps", "100000", "--layers", "2", "--no-live", "--timeout", "900",
                   "--no-fork-server",  # exec'd, as on real machines: each process is told apart by its command line
                   "--run-dir", str(Path(folder, "run")), "--events", str(events)]
        run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for(lambda: events.exists() and '"step"' in events.read_text(), 300, "the first training step")
            time.sleep(args.warmup_s)
            tree = _descendants(run.pid)
            agents = {pid: _flag(cmd, "--node") for pid, cmd in tree.items() if " agent " in cmd}
            workers = {pid: agents.get(_children()[pid][0]) for pid, cmd in tree.items() if "bamboo.launch.worker" in cmd}
            etcd_cmd = next(cmd for cmd in tree.values() if "etcd" in cmd.split()[0])
            endpoint = _flag(etcd_cmd, "--listen-client-urls").removeprefix("http://")
            job = _flag(next(cmd for cmd in tree.values() if " agent " in cmd), "--job")
            kv = EtcdKV(EtcdOptions(endpoints=(endpoint,)))
            found = MembershipStore(kv, job).get_layout()
            kv.close()
            ranked = set(_layout_nodes(found.value)) if found is not None else set()
            rates = _cpu_over([run.pid, *agents, *workers], args.window_s)
        finally:
            for pid in _descendants(run.pid):  # every node runs in a session of its own: the group kill misses them
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    standby = [rates[pid] for pid, node in workers.items() if pid in rates and node not in ranked]
    training_workers = [rates[pid] for pid, node in workers.items() if pid in rates and node in ranked]
    result = {"agents": _summary([rates[pid] for pid in agents if pid in rates]),
              "standby_workers": _summary(standby), "training_workers": _summary(training_workers),
              "launcher_no_live_cpu_s_per_hour": rates.get(run.pid)}
    say(f"{args.train_nodes} agents while training: each {result['agents'].get('mean_cpu_s_per_hour', 0):.1f} "
        f"CPU-s/h (max {result['agents'].get('max_cpu_s_per_hour', 0):.1f}); {len(standby)} standby workers: each "
        f"{result['standby_workers'].get('mean_cpu_s_per_hour', 0):.1f} CPU-s/h")
    return result


def _layout_nodes(layout: dict[str, Any]) -> list[str]:
    from bamboo.reconfig import JobLayout

    return list(JobLayout.from_dict(layout).ranks)


# -- idle agents ------------------------------------------------------------------------------------


@contextmanager
def idle_agents(count: int, folder: Path) -> Iterator[tuple[list[subprocess.Popen[bytes]], EmbeddedEtcd]]:
    """``count`` real agents on one embedded etcd, their workers a script that sleeps, first layout written."""
    sleeper = folder / "sleeper.py"
    sleeper.write_text(SLEEPER)
    with EmbeddedEtcd(folder / "etcd") as etcd:
        etcd.start()
        kv = EtcdKV(EtcdOptions(endpoints=(etcd.endpoint,)))
        store = MembershipStore(kv, "idle")
        spec = JobSpec(job="idle", stages=2, pipelines=count // 2, steps=10**6, layers=[LAYER] * 4, config={},
                       micro_batches=2, created_unix=time.time(), script=(str(sleeper),), min_nodes=count)
        kv.put(store.keys.root + "spec", spec.to_json().encode())
        agents = [subprocess.Popen([sys.executable, "-m", "bamboo.launch", "agent", "--job", "idle", "--etcd",
                                    etcd.endpoint, "--node", f"node{i:03d}", "--zone", f"zone-{i % 3}",
                                    "--run-dir", str(folder / "run")], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True) for i in range(count)]
        try:
            wait_for(lambda: store.get_layout() is not None, 300, f"the first layout of {count} idle agents")
            yield agents, etcd
        finally:
            for agent in agents:
                os.killpg(agent.pid, signal.SIGKILL)  # the agent and its sleeping worker
                agent.wait()
            kv.close()


def idle(args: argparse.Namespace, say: Log) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-cost-") as folder, \
            idle_agents(args.idle_nodes, Path(folder)) as (agents, etcd):
        time.sleep(args.warmup_s)
        etcd_pid = etcd.pid
        rates = _cpu_over([agent.pid for agent in agents] + [etcd_pid], args.window_s)
    etcd_rate = rates.pop(etcd_pid, None)
    result = {"agents": _summary(list(rates.values())), "etcd_cpu_s_per_hour": etcd_rate}
    say(f"{args.idle_nodes} idle agents: each {result['agents'].get('mean_cpu_s_per_hour', 0):.1f} CPU-s/h (max "
        f"{result['agents'].get('max_cpu_s_per_hour', 0):.1f}); etcd {etcd_rate or 0:.0f} CPU-s/h")
    return result


# -- the live view ----------------------------------------------------------------------------------


def live_child(window_s: float) -> None:
    """The live view's loop alone (module docstring); prints its CPU seconds per hour as JSON."""
    from bamboo.bench.emulated import timeouts as emulated_timeouts
    from bamboo.launch.events import EventLog, Join, RunStart, Step
    from bamboo.launch.live import EventFollower, LiveView
    from rich.console import Console

    with tempfile.TemporaryDirectory(prefix="bench-live-") as folder:
        path = Path(folder, "events.jsonl")
        log = EventLog(path)
        log.write(RunStart(t=0.0, job="live", unix_time=time.time(), target_nodes=8, stages=2, pipelines=2))
        for i in range(8):
            log.write(Join(t=0.0, node=f"node{i}", zone="a"))
        stop = threading.Event()

        def steps() -> None:
            step = 0
            while not stop.wait(1.0):
                step += 1
                log.write(Step(t=float(step), step=step, samples=32, loss=1.0, nodes_active=4, duration_s=1.0))

        threading.Thread(target=steps, daemon=True).start()
        console = Console(file=open(os.devnull, "w"), force_terminal=True, width=120)  # noqa: SIM115
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu0, started = usage.ru_utime + usage.ru_stime, time.monotonic()
        with LiveView(EventFollower(path).poll, console) as view:  # what bamboo-launch run draws
            while time.monotonic() - started < window_s:
                view.update()
                time.sleep(emulated_timeouts.LIVE_REFRESH_S)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        stop.set()
    seconds = time.monotonic() - started
    print(json.dumps({"live_view_cpu_s_per_hour": (usage.ru_utime + usage.ru_stime - cpu0) / seconds * 3600.0}))


def live_view(args: argparse.Namespace, say: Log) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--live-child", str(args.window_s)], capture_output=True,
                          text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    say(f"the live view: {result['live_view_cpu_s_per_hour']:.1f} CPU-s/h")
    return result


# -- the step time of `none`, with and without agents -----------------------------------------------


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what this process and the processes it forks write to stdout to stderr instead, while inside."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def none_steps(args: argparse.Namespace, say: Log) -> dict[str, Any]:
    from bamboo.bench.measured.steady import deepspeed_config, run_variant
    from bamboo.rc.data import stdlib_corpus
    from bamboo.rc.model import GPTSize

    size = GPTSize(layers=6, width=256, heads=8, sequence=128)
    config = deepspeed_config(4, 4)
    stdlib_corpus()
    samples: dict[str, list[float]] = {"alone": [], "with_agents": []}

    def once() -> float:
        with _stdout_to_stderr():  # DeepSpeed's workers log to stdout, which --json keeps for its one object
            workers = run_variant("none", size, config, args.steps)
        return statistics.median(max(a, b) for a, b in zip(workers[0]["times"][1:], workers[1]["times"][1:],
                                                           strict=True))

    for repeat in range(args.repeats):
        samples["alone"].append(once())
        with tempfile.TemporaryDirectory(prefix="bench-cost-") as folder, idle_agents(2, Path(folder)):
            time.sleep(args.warmup_s)
            samples["with_agents"].append(once())
        say(f"  none, repeat {repeat + 1}: {samples['alone'][-1] * 1e3:.1f} ms alone, "
            f"{samples['with_agents'][-1] * 1e3:.1f} ms with its two agents")
    alone, with_agents = statistics.median(samples["alone"]), statistics.median(samples["with_agents"])
    say(f"redundancy none, P = 2: {alone * 1e3:.1f} ms per step alone, {with_agents * 1e3:.1f} ms with its agents "
        f"({(with_agents / alone - 1) * 100:+.1f}%)")
    return {"none_step_ms_alone": alone * 1e3, "none_step_ms_with_agents": with_agents * 1e3,
            "none_step_with_agents_over_alone": with_agents / alone,
            "samples_ms": {k: [v * 1e3 for v in vs] for k, vs in samples.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--parts", default="training,idle,live,none",
                        help="which measurements, comma separated: training, idle, live, none")
    parser.add_argument("--train-nodes", type=int, default=8, help="nodes of the training run")
    parser.add_argument("--idle-nodes", type=int, default=64, help="idle agents")
    parser.add_argument("--window-s", type=float, default=60.0, help="how long CPU is measured, s")
    parser.add_argument("--warmup-s", type=float, default=10.0, help="pause before measuring, s")
    parser.add_argument("--steps", type=int, default=8, help="none: iterations per run (the first is warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="none: interleaved repeats")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--live-child", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.live_child is not None:
        live_child(args.live_child)
        return 0
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(parts) - {"training", "idle", "live", "none"})
    if unknown or args.train_nodes < 4 or args.idle_nodes < 2 or args.window_s <= 0:
        parser.error(f"--parts takes training, idle, live, none (got {unknown}); --train-nodes >= 4, "
                     "--idle-nodes >= 2, --window-s > 0")
    say = Log()
    say(f"load {os.getloadavg()[0]:.1f}; goal: below {GOAL_CPU_S_PER_HOUR:.0f} CPU-s per hour (1% of a core) each")
    measures = {"training": training, "idle": idle, "live": live_view, "none": none_steps}
    results: dict[str, Any] = {"goal_cpu_s_per_hour": GOAL_CPU_S_PER_HOUR, "window_s": args.window_s}
    for part in parts:
        results[part] = measures[part](args, say)
    results["load_avg_1m"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
