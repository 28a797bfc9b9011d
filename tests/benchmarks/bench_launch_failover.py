"""Benchmark: the pause of a `kill -9` in `bamboo-launch run`, against checkpoint/restart and torchft, same run.

Run: `flock /tmp/bamboo-heavy.lock .venv/bin/python tests/benchmarks/bench_launch_failover.py` (`--help` for the
flags). Not collected by pytest. Ratios are printed, not asserted.

The same cluster and market for both launchers: P=2, D=2 on P x D nodes (`--spares` more), the built-in example
GPT (`--layers`). Kills come one at a time, rotating over the stages and the pipelines, each at a different point
of a step (a fraction of the recent step time after a step ended: early kills land in forward passes, late ones
in backward passes), with SIGKILL of the node's processes; a replacement node starts `--allocation-delay` seconds
after each kill (the market's join). The next kill waits until the job trains on P x D nodes again and a few
steps have passed, so it hits a healthy layout.

1. **bamboo** (`bamboo.bench.emulated.run.run_cluster`, `during` callback): the shadow fails over, the pipelines are
   rebuilt with the replacement. The pause is measured two ways from the kill (the wall time just before the
   signal), with the shadow's `failover` record: to its first instruction of the merged schedule
   (`resumed_unix`), and to the end of the failed step (`step_end_unix`).
2. **checkpoint/restart** (`bamboo.bench.measured.torchrun.run_checkpoint_restart`): torchrun elastic agents
   (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, which its restart on gloo needs), DeepSpeed's `PipelineEngine` on the
   same model, global batch and data order, DeepSpeed checkpoints every K steps (Young's rule, with the mean time
   between kills of the bamboo run above; its kills come no more often than that). Its pause: from the kill to the
   start and to the end of the first step after the restart; the steps trained again.
3. **torchft** 0.2.0, if it imports from `--torchft-python` (a separate venv: it is not a project dependency): 3
   replica groups of one process each train the same GPT (whole, data parallel) with a Lighthouse (heartbeat
   timeout `--torchft-heartbeat-ms`); one replica group (its process, with its Manager server) is killed with
   SIGKILL, then restarted, in turns. The survivors' pause: from the kill to the quorum of their first step that
   commits, and to its end; the steps they discarded. If torchft cannot run, the table says why.

torchft's venv, once (it shares this repository's venv through a .pth file; `pip install --dry-run torchft==0.2.0`
in the project's venv changes none of its pins, but torchft is not a project dependency):
    .venv/bin/python -m venv /work/bench-venv
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \
        > /work/bench-venv/lib/python3.11/site-packages/bamboo-main-venv.pth
    /work/bench-venv/bin/pip install torchft==0.2.0

The table gives each system's kills, pause p50/p99 both ways, steps trained again, and the ratio of each
baseline's p50 to bamboo's. Goal for bamboo on this 2-core machine: p50 <= 0.25 s and p99 <= 1 s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import Log, percentile
from _bench_common import wait_for as _wait

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))

PHASES = (0.1, 0.3, 0.5, 0.7, 0.9)
"""Where in a step the kills land: this fraction of the recent step time after a step ended."""
GOAL_P50_S = 0.25
GOAL_P99_S = 1.0


class EventWatch:
    """Follows a run's event log: the records so far, and the wall time (Unix) of each."""

    def __init__(self, path: Path) -> None:
        from bamboo.launch.live import EventFollower

        self._follower = EventFollower(path)
        self.events: list[Any] = []
        self.start_unix: float | None = None

    def poll(self) -> list[Any]:
        from bamboo.launch.events import RunStart

        fresh = self._follower.poll()
        for event in fresh:
            if isinstance(event, RunStart):
                self.start_unix = event.unix_time
        self.events.extend(fresh)
        return self.events

    def of(self, kind: type, since_t: float = -1.0) -> list[Any]:
        return [event for event in self.poll() if isinstance(event, kind) and event.t > since_t]

    def unix(self, t: float) -> float:
        assert self.start_unix is not None, "no run_start record yet"
        return self.start_unix + t


def _kill_at_phase(watch: EventWatch, phase: float, kill: Callable[[], float]) -> float:
    """Wait for the next step to end, then kill ``phase`` of a step later; returns the kill's wall time."""
    from bamboo.launch.events import Step

    seen = len(watch.of(Step))
    _wait(lambda: len(watch.of(Step)) > seen, 60.0, "a step")
    steps = watch.of(Step)
    last = steps[-1]
    duration = statistics.median(step.duration_s for step in steps[-5:])
    target = watch.unix(last.t) + phase * duration
    while target < time.time():  # the record reached us late: aim at the same point of a later step
        target += duration
    time.sleep(max(0.0, target - time.time()))
    return kill()


# ---- 1. bamboo ------------------------------------------------------------------------------------------------


def bamboo_kills(args: argparse.Namespace, say: Log) -> dict[str, Any]:
    from bamboo.bench.emulated.run import RunOptions, run_cluster
    from bamboo.launch.events import Failover, Join, Reconfiguration, Step
    from bamboo.reconfig import JobLayout

    stages, pipelines = 2, 2
    kills: list[dict[str, Any]] = []
    errors: list[str] = []
    run_dir = Path(tempfile.mkdtemp(prefix="bench-launch-bamboo-"))
    options = RunOptions(redundancy="eflb", nodes=stages * pipelines + args.spares, stages=stages, pipelines=pipelines,
                         steps=args.bamboo_steps, zones=("a", "b", "c"), time_scale=1.0, run_dir=str(run_dir),
                         size={"layers": args.layers}, timeout_s=args.timeout, group_timeout_s=20.0,
                         fork_server=False)  # exec'd, as on real machines

    def during(handles: Any) -> None:
        watch = EventWatch(handles.events)
        try:
            _wait(lambda: len(watch.of(Step)) >= args.settle_steps, 120.0, "the first steps")
            for index in range(args.kills):
                layout = JobLayout.from_dict(handles.membership.get_layout().value)
                stage, pipeline = index % stages, (index // stages) % pipelines
                victim = layout.owners[pipeline][stage]
                phase = PHASES[index % len(PHASES)]
                zone = handles.cluster.zones.get(victim, "a")

                def kill(victim: str = victim) -> float:
                    at = time.time()
                    handles.cluster.kill(victim)
                    return at

                at = _kill_at_phase(watch, phase, kill)
                kills.append({"node": victim, "stage": stage, "pipeline": pipeline, "phase": phase, "at": at})
                time.sleep(args.allocation_delay)
                replacement = handles.cluster.add(zone)
                say(f"bamboo kill {index + 1}/{args.kills}: {victim} (stage {stage}, pipeline {pipeline}, "
                    f"{phase:.0%} into a step); added {replacement}")
                failover = _wait(lambda v=victim, a=at: [f for f in watch.of(Failover) if f.victim == v
                                                         and (f.caught_unix or 0.0) > a - 1.0], 60.0,
                                 f"the failover of {victim}")[0]
                _wait(lambda r=replacement: [j for j in watch.of(Join) if j.node == r], 60.0, f"{replacement} joining")
                whole = _wait(lambda f=failover: [r for r in watch.of(Reconfiguration, f.t) if r.pipelines == pipelines],
                              180.0, f"a reconfiguration back to {pipelines} pipelines")[0]
                _wait(lambda w=whole: len(watch.of(Step, w.t)) >= args.settle_steps, 120.0, "steps after it")
                time.sleep(args.settle_s)
        except Exception as error:  # the table reports the kills that were measured
            errors.append(f"{type(error).__name__}: {error}")
            say(f"bamboo killer stopped: {error}")
        say("bamboo: the kills are measured; ending the run (every node killed)")
        for node in handles.cluster.alive():
            handles.cluster.kill(node)

    say(f"bamboo: {options.nodes} agents, P={stages} D={pipelines}, {args.bamboo_steps} steps, {args.kills} kills")
    result = run_cluster(options, during=during, progress=lambda message: None)
    from bamboo.launch.events import read_events

    events = read_events(result.events)
    failovers = [event for event in events if isinstance(event, Failover)]
    rows = []
    for kill in kills:
        match = next((f for f in failovers if f.victim == kill["node"] and f.caught_unix is not None
                      and f.caught_unix >= kill["at"] - 1.0), None)
        if match is None:
            errors.append(f"no failover record for the kill of {kill['node']}")
            continue
        rows.append({**kill, "to_merged_s": match.resumed_unix - kill["at"],
                     "to_step_end_s": match.step_end_unix - kill["at"], "caught_s": match.caught_unix - kill["at"]})
    steps = [event for event in events if isinstance(event, Step)]
    reconfigurations = [event.duration_s for event in events if isinstance(event, Reconfiguration)]
    return {"rows": rows, "errors": errors, "run_dir": str(run_dir), "steps": len({s.step for s in steps}),
            "reconfiguration_s": statistics.median(reconfigurations) if reconfigurations else math.nan,
            "reconfigurations": len(reconfigurations),
            "redone": len(steps) - len({s.step for s in steps}), "timed_out": result.timed_out,
            "step_s": statistics.median(s.duration_s for s in steps) if steps else math.nan,
            "kill_interval_s": (kills[-1]["at"] - kills[0]["at"]) / (len(kills) - 1) if len(kills) > 1 else None}


# ---- 2. checkpoint/restart --------------------------------------------------------------------------------------


def checkpoint_restart_kills(args: argparse.Namespace, mtbf_s: float | None, say: Log) -> dict[str, Any]:
    from bamboo.bench.measured.torchrun import CheckpointRestartOptions, run_checkpoint_restart
    from bamboo.launch.events import Checkpoint, Step

    stages, pipelines = 2, 2
    kills: list[dict[str, Any]] = []
    errors: list[str] = []
    run_dir = Path(tempfile.mkdtemp(prefix="bench-launch-restart-"))
    options = CheckpointRestartOptions(nodes=stages * pipelines + args.spares, stages=stages, pipelines=pipelines,
                                       steps=args.restart_steps, zones=("a", "b", "c"), time_scale=1.0,
                                       run_dir=str(run_dir), size={"layers": args.layers}, mtbf_s=mtbf_s,
                                       timeout_s=args.timeout)

    def during(handles: Any) -> None:
        watch = EventWatch(handles.events)
        try:
            _wait(lambda: watch.of(Checkpoint), 120.0, "the first checkpoint (K is chosen with it)")
            for index in range(args.restart_kills):
                stage, pipeline = index % stages, (index // stages) % pipelines
                roles = {node: role for node, role in handles.roles().items() if node in handles.alive()}
                victim = next((node for node, role in roles.items() if role == (stage, pipeline)), None)
                if victim is None:
                    raise RuntimeError(f"no live node holds stage {stage} of pipeline {pipeline}: {roles}")
                phase = PHASES[index % len(PHASES)]
                zone = handles.cluster.zones.get(victim, "a")
                at = _kill_at_phase(watch, phase, lambda v=victim: handles.kill(v))
                kills.append({"node": victim, "stage": stage, "pipeline": pipeline, "phase": phase, "at": at})
                time.sleep(args.allocation_delay)
                replacement = handles.add(zone)
                say(f"checkpoint/restart kill {index + 1}/{args.restart_kills}: {victim} (stage {stage}, "
                    f"pipeline {pipeline}, {phase:.0%} into a step); added {replacement}")
                whole = _wait(lambda a=at: [s for s in watch.of(Step) if watch.unix(s.t) > a
                                            and s.nodes_active == stages * pipelines], 300.0,
                              f"training on {stages * pipelines} nodes again")[0]
                _wait(lambda w=whole: len(watch.of(Step, w.t)) >= args.settle_steps, 120.0, "steps after the restart")
                time.sleep(max(args.settle_s, (mtbf_s or 0.0) - (time.time() - at)))  # kills as often as bamboo's
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")
            say(f"checkpoint/restart killer stopped: {error}")
        handles.stop()  # the kills are measured

    say(f"checkpoint/restart: {options.nodes} torchrun agents, {args.restart_steps} steps, {args.restart_kills} kills")
    result = run_checkpoint_restart(options, during=during, progress=lambda message: say(f"  {message}"))
    rows = []
    joins = [cost.to_step_end_s for cost in result.restarts if cost.cause == "join"]
    for kill in kills:
        cost = next((c for c in result.restarts if c.node == kill["node"] and abs(c.at_unix - kill["at"]) < 0.5),
                    None)
        if cost is None:
            errors.append(f"no restart measured after the kill of {kill['node']}")
            continue
        rows.append({**kill, "to_merged_s": cost.to_first_step_s, "to_step_end_s": cost.to_step_end_s,
                     "redone": cost.redone_steps, "load_s": cost.load_s, "phases": cost.phases(),
                     "pipelines": cost.pipelines, "absorbed": list(cost.absorbed)})
    return {"rows": rows, "errors": errors, "run_dir": str(run_dir), "timed_out": result.timed_out,
            "join_restarts_s": joins,
            "interval": result.interval.describe() if result.interval else "none", "steps": result.steps_done}


# ---- 3. torchft -------------------------------------------------------------------------------------------------


def torchft_lighthouse(args: argparse.Namespace) -> None:
    """Run a torchft Lighthouse in this process; write its address to ``--torchft-out``; serve until killed."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=args.torchft_join_ms,
                              heartbeat_timeout_ms=args.torchft_heartbeat_ms)
    out = Path(args.torchft_out)
    partial = out.with_suffix(".tmp")
    partial.write_text(server.address())
    os.replace(partial, out)
    while True:
        time.sleep(3600)


def torchft_replica(args: argparse.Namespace) -> None:
    """One torchft replica group (one process): the example GPT, whole, trained data parallel with its peers."""
    import datetime

    import torch
    from bamboo.launch.example import EXAMPLE_CONFIG, example_program
    from bamboo.rc.model import GPTSize, build_layers, gpt_layer_specs, lm_loss
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    replica, out = args.torchft_replica, Path(args.torchft_out)
    specs = gpt_layer_specs(GPTSize(layers=args.layers))
    model = build_layers(specs, range(len(specs)), 0)  # the same initial weights on every replica
    params = EXAMPLE_CONFIG["optimizer"]["params"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=tuple(params["betas"]),
                                  weight_decay=params["weight_decay"])
    program = example_program({"layers": args.layers}, EXAMPLE_CONFIG, 0)
    micro_batches = int(EXAMPLE_CONFIG["gradient_accumulation_steps"])
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=10)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
                      load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                                     optimizer.load_state_dict(state["optim"])),
                      state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
                      replica_id=f"replica{replica}", store_addr="127.0.0.1", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=args.torchft_lighthouse, hostname="127.0.0.1", timeout=timeout,
                      quorum_timeout=datetime.timedelta(seconds=60))
    while True:
        started = time.time()
        optimizer.zero_grad()
        manager.start_quorum()
        manager.wait_quorum()
        quorum = time.time()
        step = manager.current_step()
        rank = manager.participating_rank() or 0
        for k in range(micro_batches):
            tokens, labels = program.microbatch(step, rank * micro_batches + k)
            (lm_loss(model(tokens), labels) / micro_batches).backward()
        works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
        for work in works:
            work.wait()
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        line = {"replica": replica, "step": step, "start": started, "quorum": quorum, "end": time.time(),
                "committed": bool(committed), "participants": manager.num_participants()}
        data = (json.dumps(line) + "\n").encode()
        fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)  # one write per line: the replicas share the file
        finally:
            os.close(fd)


def torchft_kills(args: argparse.Namespace, say: Log) -> dict[str, Any]:
    python = Path(args.torchft_python)
    if not python.exists():
        return {"status": f"not run: {python} does not exist (torchft is installed only in a separate venv; "
                          f"see --torchft-python)"}
    probe = subprocess.run([str(python), "-c", "import torchft, torch; print(torchft.__file__, torch.__version__)"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return {"status": f"not run: torchft does not import with {python}: "
                          f"{(probe.stderr.strip().splitlines() or ['?'])[-1]}"}
    work = Path(tempfile.mkdtemp(prefix="bench-launch-torchft-"))
    me = str(Path(__file__).resolve())
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(work / f"{name}.log", "ab")  # noqa: SIM115
        process = subprocess.Popen([str(python), me, *argv], stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        processes[name] = process
        return process

    def lines() -> list[dict[str, Any]]:
        try:
            text = (work / "steps.jsonl").read_text()
        except FileNotFoundError:
            return []
        records = []
        for line in text.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # the last line of a replica killed while it wrote
                continue
        return records

    errors: list[str] = []
    kills: list[dict[str, Any]] = []
    try:
        start("lighthouse", ["--torchft-serve-lighthouse", "--torchft-heartbeat-ms", str(args.torchft_heartbeat_ms),
                             "--torchft-join-ms", str(args.torchft_join_ms), "--torchft-out", str(work / "address")])
        _wait(lambda: (work / "address").exists(), 60.0, "the lighthouse")
        address = f"http://127.0.0.1:{(work / 'address').read_text().strip().rsplit(':', 1)[1]}"

        def replica(index: int) -> None:
            start(f"replica{index}", ["--torchft-replica", str(index), "--torchft-lighthouse", address,
                                      "--torchft-out", str(work / "steps.jsonl"), "--layers", str(args.layers)])

        for index in range(args.torchft_replicas):
            replica(index)
        say(f"torchft: lighthouse at {address} (heartbeat timeout {args.torchft_heartbeat_ms} ms), "
            f"{args.torchft_replicas} replica groups")
        everyone = args.torchft_replicas
        _wait(lambda: sum(1 for x in lines() if x["committed"] and x["participants"] == everyone) >= 10 * everyone,
              300.0, "10 steps of every replica group")
        for index in range(args.torchft_kills):
            victim = index % args.torchft_replicas
            phase = PHASES[index % len(PHASES)]
            mine = [x for x in lines() if x["replica"] == victim and x["committed"]][-5:]
            duration = statistics.median(x["end"] - x["start"] for x in mine)
            target = mine[-1]["end"] + phase * duration
            while target < time.time():
                target += duration
            time.sleep(max(0.0, target - time.time()))
            at = time.time()
            os.killpg(processes[f"replica{victim}"].pid, signal.SIGKILL)
            processes[f"replica{victim}"].wait()
            kills.append({"replica": victim, "phase": phase, "at": at})
            say(f"torchft kill {index + 1}/{args.torchft_kills}: replica group {victim} ({phase:.0%} into a step)")
            survivors = [r for r in range(args.torchft_replicas) if r != victim]
            _wait(lambda a=at, s=survivors: all(any(x["replica"] == r and x["committed"] and x["quorum"] > a
                                                    for x in lines()) for r in s), 120.0, "the survivors' progress")
            restarted = time.time()
            replica(victim)  # restarted: it recovers its state from a peer and rejoins
            back = _wait(lambda a=at, v=victim: [x for x in lines() if x["replica"] == v and x["committed"]
                                                 and x["participants"] == everyone and x["start"] > a], 180.0,
                         f"replica group {victim} rejoining")[0]
            kills[-1]["rejoin_s"] = back["end"] - restarted
            time.sleep(args.settle_s)
    except Exception as error:
        errors.append(f"{type(error).__name__}: {error}")
        say(f"torchft stopped: {error}")
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    rows = []
    records = lines()
    for kill in kills:
        for survivor in (r for r in range(args.torchft_replicas) if r != kill["replica"]):
            mine = [x for x in records if x["replica"] == survivor]
            first = next((x for x in mine if x["committed"] and x["quorum"] > kill["at"]), None)
            if first is None:
                continue
            discarded = sum(1 for x in mine if not x["committed"] and kill["at"] - 1.0 < x["end"] < first["end"])
            rows.append({**kill, "survivor": survivor, "to_merged_s": first["quorum"] - kill["at"],
                         "to_step_end_s": first["end"] - kill["at"], "redone": discarded})
    steps = [x["end"] - x["start"] for x in records if x["committed"] and x["participants"] == args.torchft_replicas]
    rejoins = [kill["rejoin_s"] for kill in kills if "rejoin_s" in kill]
    return {"status": "ran", "rows": rows, "errors": errors, "work": str(work), "kills": len(kills),
            "replicas": args.torchft_replicas, "heartbeat_ms": args.torchft_heartbeat_ms,
            "rejoin_s": statistics.median(rejoins) if rejoins else math.nan,
            "redone": sum(max((row["redone"] for row in rows if row["at"] == kill["at"]), default=0) for kill in kills),
            "step_s": statistics.median(steps) if steps else math.nan}


# ---- the table --------------------------------------------------------------------------------------------------


def _summary(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    merged = [row["to_merged_s"] for row in rows]
    ends = [row["to_step_end_s"] for row in rows]
    return {"a50": percentile(merged, 50), "a99": percentile(merged, 99), "b50": percentile(ends, 50),
            "b99": percentile(ends, 99)}


def args_replicas(torchft: dict[str, Any]) -> int:
    return int(torchft.get("replicas", 3))


def print_table(bamboo: dict[str, Any], restart: dict[str, Any] | None, torchft: dict[str, Any] | None) -> None:
    base = _summary(bamboo["rows"])
    print()
    print("Pause after a kill -9 (seconds). A: kill -> first instruction of the merged schedule (bamboo), first step")
    print("after the restart starts (checkpoint/restart), quorum of the first committed step (torchft).")
    print("B: kill -> end of the failed step (bamboo), of the first step after the restart, of the first committed step.")
    print(f"{'system':<40} {'kills':>5} {'A p50':>7} {'A p99':>7} {'B p50':>7} {'B p99':>7} {'redone':>7} "
          f"{'A p50 x':>8} {'B p50 x':>8}")

    def line(name: str, kills: int, summary: dict[str, float], redone: str, ratio: bool) -> None:
        a_ratio = f"{summary['a50'] / base['a50']:.1f}x" if ratio and base["a50"] > 0 else "1.0x"
        b_ratio = f"{summary['b50'] / base['b50']:.1f}x" if ratio and base["b50"] > 0 else "1.0x"
        print(f"{name:<40} {kills:>5} {summary['a50']:>7.3f} {summary['a99']:>7.3f} {summary['b50']:>7.3f} "
              f"{summary['b99']:>7.3f} {redone:>7} {a_ratio:>8} {b_ratio:>8}")

    line("bamboo (failover)", len(bamboo["rows"]), base, str(bamboo["redone"]), False)
    if restart is not None:
        if restart["rows"]:
            redone = sum(row["redone"] for row in restart["rows"])
            line("torchrun elastic + DeepSpeed ckpt/restart", len(restart["rows"]), _summary(restart["rows"]),
                 str(redone), True)
        else:
            print(f"{'torchrun elastic + DeepSpeed ckpt/restart':<40} no kill measured: {restart['errors']}")
    if torchft is not None:
        if torchft.get("status") != "ran":
            print(f"{'torchft 0.2.0':<40} {torchft['status']}")
        elif torchft["rows"]:
            line("torchft 0.2.0 (survivors' pauses)", torchft["kills"], _summary(torchft["rows"]),
                 str(torchft["redone"]), True)
        else:
            print(f"{'torchft 0.2.0':<40} no kill measured: {torchft['errors']}")
    print()
    print(f"bamboo: {bamboo['reconfigurations']} reconfigurations after the failovers, median "
          f"{bamboo['reconfiguration_s']:.2f} s each (not in the pause); median step {bamboo['step_s']:.3f} s")
    if restart is not None:
        joins = restart.get("join_restarts_s") or []
        print(f"checkpoint/restart: {restart['interval']}; restarts for a joining replacement (when it missed the "
              f"kill's restart): {len(joins)}, median {statistics.median(joins) if joins else math.nan:.2f} s each")
        if restart["rows"]:
            phases = {name: statistics.median(row["phases"][name] for row in restart["rows"])
                      for name in restart["rows"][0]["phases"]}
            print("checkpoint/restart pause, median of each phase: "
                  + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items()))
    if torchft is not None and torchft.get("status") == "ran":
        print(f"torchft: median committed step {torchft['step_s']:.3f} s on {args_replicas(torchft)} replica groups; "
              f"heartbeat timeout {torchft['heartbeat_ms']} ms; a restarted replica group trains again "
              f"{torchft['rejoin_s']:.2f} s after its start (median); p50/p99 over {len(torchft['rows'])} survivor "
              f"pauses")
    met = base["b50"] <= GOAL_P50_S and base["b99"] <= GOAL_P99_S
    print(f"bamboo goal (kill -> end of the failed step): p50 <= {GOAL_P50_S} s and p99 <= {GOAL_P99_S} s: "
          f"{'met' if met else 'missed'} (p50 {base['b50']:.3f} s, p99 {base['b99']:.3f} s); kill -> merged "
          f"schedule p50 {base['a50']:.3f} s, p99 {base['a99']:.3f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20, help="kills in the bamboo run (default 20)")
    parser.add_argument("--bamboo-steps", type=int, default=None,
                        help="steps of the bamboo run; enough for the kills and their reconfigurations "
                             "(default 300 per kill + 200; the run ends once the kills are measured)")
    parser.add_argument("--restart-kills", type=int, default=6, help="kills in the checkpoint/restart run (default 6)")
    parser.add_argument("--restart-steps", type=int, default=None,
                        help="steps of the checkpoint/restart run (default 400 per kill + 100; the run ends once the "
                             "kills are measured)")
    parser.add_argument("--torchft-kills", type=int, default=6, help="kills in the torchft run (default 6)")
    parser.add_argument("--torchft-replicas", type=int, default=3, help="torchft replica groups (default 3)")
    parser.add_argument("--torchft-heartbeat-ms", type=int, default=2000,
                        help="the Lighthouse's heartbeat timeout (default 2000 ms, as bamboo's 2 s lease; "
                             "torchft's own default is 5000)")
    parser.add_argument("--torchft-join-ms", type=int, default=60000, help="the Lighthouse's join timeout (ms)")
    parser.add_argument("--torchft-python", default="/work/bench-venv/bin/python",
                        help="a Python with torchft 0.2.0 and this repository's packages (default %(default)s)")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks of the example GPT (default 4)")
    parser.add_argument("--spares", type=int, default=0,
                        help="nodes beyond P x D at the start, in both runs (default 0: a kill leaves one pipeline "
                             "until its replacement joins)")
    parser.add_argument("--allocation-delay", type=float, default=0.0,
                        help="seconds from a kill to the start of its replacement node, in both runs (default 0)")
    parser.add_argument("--settle-steps", type=int, default=5,
                        help="steps of the new layout before the next kill (default 5)")
    parser.add_argument("--settle-s", type=float, default=1.0,
                        help="seconds to wait, after the steps of --settle-steps, before the next kill (default 1)")
    parser.add_argument("--timeout", type=float, default=1500.0, help="limit of each run in seconds (default 1500)")
    parser.add_argument("--skip", nargs="*", default=[], choices=("restart", "torchft"), help="baselines to leave out")
    parser.add_argument("--json", type=Path, default=None, help="also write every measurement to this JSON file")
    parser.add_argument("--torchft-serve-lighthouse", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torchft-replica", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--torchft-lighthouse", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--torchft-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.torchft_serve_lighthouse:
        torchft_lighthouse(args)
        return 0
    if args.torchft_replica is not None:
        torchft_replica(args)
        return 0
    if args.kills < 1:
        parser.error(f"--kills must be >= 1, got {args.kills}")
    args.bamboo_steps = args.bamboo_steps or 300 * args.kills + 200
    args.restart_steps = args.restart_steps or 400 * args.restart_kills + 100
    say = Log()
    bamboo = bamboo_kills(args, say)
    say(f"bamboo: {len(bamboo['rows'])} kills measured; run dir {bamboo['run_dir']}; errors: {bamboo['errors'] or 'none'}")
    restart = None
    if "restart" not in args.skip:
        restart = checkpoint_restart_kills(args, bamboo["kill_interval_s"], say)
        say(f"checkpoint/restart: {len(restart['rows'])} kills measured, {restart['interval']}; "
            f"run dir {restart['run_dir']}; errors: {restart['errors'] or 'none'}")
    torchft = None if "torchft" in args.skip else torchft_kills(args, say)
    print_table(bamboo, restart, torchft)
    if args.json:
        args.json.write_text(json.dumps({"bamboo": bamboo, "restart": restart, "torchft": torchft}, indent=2,
                                        default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
