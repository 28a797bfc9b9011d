"""Benchmark: pure data parallelism (P = 1), a `kill -9` of one replica: bamboo-rc against torchft and torchrun.

Run: `flock /tmp/bamboo-heavy.lock .venv/bin/python tests/benchmarks/bench_dp_failover.py` (`--help` for the
flags). Not collected by pytest (pytest collects `test_*.py` only). Ratios are printed, not asserted.

Every system trains the same model on the same data: `bamboo-rc verify`'s example decoder (`GPTSize`,
`--layers` blocks) with `verify`'s DeepSpeed config (AdamW, WarmupLR, clipping 1.0, M = 4 microbatches of 2
samples per replica and step), `--replicas` D data-parallel replicas (one process each), replica d training
global microbatches d*M .. d*M+M-1 of `GlobalBatchSampler.microbatch(step, index)`. The fault-free reference is
`bamboo.rc.reference.train_reference` (one process, the global batch of D*M microbatches every step), the one
`verify` compares with. "max rel diff" is the largest, over every parameter tensor of a surviving replica, of
`max|a - b| / max|b|` against the reference after the same number of steps (`verify`'s measure).

Each kill is its own short run (so each has its own result to compare), `--kills` per system, rotating over the
victims and over the point of the step where the kill lands (10%, 30%, 50%, 70%, 90%: early kills land in the
forward passes, late ones in the backward passes or the all-reduce):

1. **bamboo** (`bamboo.rc.verify.run_verify`, P = 1, D replicas, `--modes`, default lazy `lflb` and eager
   `eflb`): the victim SIGKILLs itself at the instruction at that fraction of its step's stream
   (`bamboo.rc.ring.fault_free_ring_stream`), in step `--kill-step`; its ring successor (the shadow) gives the
   victim's share. The failure detector is verify's parent process (`waitpid`), i.e. immediate. Pause A: from
   the kill to the last survivor resuming; B: to the last survivor ending the failed step (what `bamboo-rc
   verify` prints). No replacement: the D-1 survivors keep the global batch.
2. **torchft** 0.2.0 (`--torchft-python`, a separate venv: torchft is not a project dependency): a Lighthouse
   (heartbeat timeout `--torchft-heartbeat-ms`) and D replica groups of one process each, with a `Manager`
   and torchft's fault-tolerant `DistributedDataParallel` wrapper (`ddp`) or `Manager.allreduce` of each
   gradient (`manager`), one row each (`--torchft-variants`); every group starts before the first quorum. Replica group d trains microbatches d*M.. of the step
   (a fixed shard per group, as torchft's `DistributedSampler` gives). The victim group's process (with its
   Manager server) is SIGKILLed that fraction of a step after a step ended, then started again at once (a
   spare node; it heals from a peer and rejoins); the run stops two steps after it is back. Pause A: from the
   kill to the quorum of the survivors' first committed step; B: to its end; steps redone: the survivors'
   discarded (uncommitted) steps. Steps the survivors commit without the victim's share make the result
   differ from the reference. A survivor that crashes is recorded for that kill.
3. **torchrun** elastic restart from a checkpoint (`torch.distributed.run --standalone --nproc-per-node D
   --max-restarts`, monitor interval 0.1 s): D workers on gloo with `torch.nn.parallel.DistributedDataParallel`;
   rank 0 saves model, optimizer and scheduler every `--ckpt-every` K steps (synchronously, atomically). The
   victim worker is SIGKILLed that fraction of a step after a step ended, the agent restarts every worker at
   once (the most favourable case: no node to wait for), they load the last checkpoint and train the lost steps
   again. Pause A: from the kill to the first step after the restart starting; B: to its end; steps redone:
   steps completed before the kill and trained again after the restart.

The table gives, per system, the kills, pause p50/p99 both ways, the largest max rel diff over its kills, the
steps redone, and each baseline's p50 (A and B) over bamboo's first mode's p50 measured in the same run.
`--json OUT` writes every measurement.

torchft's venv, once (it shares this repository's venv through a .pth file):
    .venv/bin/python -m venv /work/bench-venv
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \
        > /work/bench-venv/lib/python3.11/site-packages/bamboo-main-venv.pth
    /work/bench-venv/bin/pip install torchft==0.2.0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
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
"""Where in a step the kills land: this fraction of the victim's stream (bamboo) or of the recent step time
after a step ended (the baselines)."""
SEED = 0


def _append_record(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, in one write: several processes append to the same file."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def _read_records(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a process killed while it wrote
            continue
    return records


# ---- the model, the data and the reference (shared by every system) ---------------------------------------------


class Replica:
    """One data-parallel replica of the example decoder: the whole model with verify's optimizer,
    scheduler and clipping (`TrainableSlice`), and its share of each step's global batch."""

    def __init__(self, layers: int, replicas: int) -> None:
        import torch
        from bamboo.rc.config import load_config
        from bamboo.rc.data import GlobalBatchSampler
        from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss
        from bamboo.rc.state import TrainableSlice
        from bamboo.rc.verify import DEFAULT_CONFIG
        from bamboo.rc.worker import exact_mode

        exact_mode()
        self.size = GPTSize(layers=layers)
        self.training = load_config(DEFAULT_CONFIG, pipelines=replicas)
        if self.training.bf16:
            raise ValueError("the benchmark's replicas train in fp32; verify's config asks for bf16")
        self.sampler = GlobalBatchSampler(self.training.micro_batch_size, self.size.sequence, seed=SEED)
        specs = gpt_layer_specs(self.size)
        self.whole = TrainableSlice(specs, range(len(specs)), self.training, SEED)
        self.whole.zero_grads()
        self.micro_batches = self.training.micro_batches
        self.loss_fn = lm_loss
        whole = self.whole

        class Model(torch.nn.Module):
            """The decoder's layers under a module a DDP wrapper can hold; forward(tokens, step, index) runs
            each layer under its (seed, step, microbatch, layer) generator, as bamboo and the reference do."""

            def __init__(self) -> None:
                super().__init__()
                self.layers = whole.layers

            def forward(self, tokens: torch.Tensor, step: int, index: int) -> torch.Tensor:
                return whole.forward(tokens, step=step, microbatch=index)

        self.module = Model()

    def microbatches(self, replica: int) -> range:
        """The global microbatch indices of `replica`'s share of a step."""
        return range(replica * self.micro_batches, (replica + 1) * self.micro_batches)

    def share_backward(self, model: Any, step: int, replica: int, no_sync: Callable[[], Any] | None) -> float:
        """Forward and backward of `replica`'s share of step `step` through `model` (each microbatch's loss
        over M: the all-reduce averages the replicas); gradient sync only on the last microbatch when
        `no_sync` is given. Returns the share's mean loss."""
        import contextlib

        total = 0.0
        indices = self.microbatches(replica)
        for k, index in enumerate(indices):
            batch = self.sampler.microbatch(step, index)
            quiet = no_sync() if no_sync is not None and k < len(indices) - 1 else contextlib.nullcontext()
            with quiet:
                loss = self.loss_fn(model(batch.tokens, step, index), batch.labels)
                (loss / self.micro_batches).backward()
            total += float(loss.detach())
        return total / len(indices)

    def optimizer_step(self) -> None:
        """Clip by the global norm and step (the reference's math); zeroes the gradients."""
        from bamboo.rc.state import clip_coefficient

        self.whole.apply_step(clip_coefficient(self.training.gradient_clipping, self.whole.squared_grad_norm()))

    def save_layers(self, path: Path) -> None:
        import torch

        partial = path.with_suffix(".tmp")
        torch.save([layer.state_dict() for layer in self.whole.layers], partial)
        os.replace(partial, path)


class References:
    """The fault-free reference after N steps (`train_reference`, as `verify` trains it), cached per N."""

    def __init__(self, layers: int, replicas: int) -> None:
        self.layers, self.replicas = layers, replicas
        self._cache: dict[int, list[dict[str, Any]]] = {}

    def states(self, steps: int) -> list[dict[str, Any]]:
        if steps not in self._cache:
            from bamboo.rc.config import load_config
            from bamboo.rc.data import GlobalBatchSampler
            from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss
            from bamboo.rc.reference import train_reference
            from bamboo.rc.verify import DEFAULT_CONFIG
            from bamboo.rc.worker import exact_mode

            exact_mode()
            size = GPTSize(layers=self.layers)
            training = load_config(DEFAULT_CONFIG, pipelines=self.replicas)
            sampler = GlobalBatchSampler(training.micro_batch_size, size.sequence, seed=SEED)
            self._cache[steps] = train_reference(gpt_layer_specs(size), lm_loss, training, sampler, steps,
                                                 self.replicas, SEED).layer_states
        return self._cache[steps]

    def max_relative_diff(self, path: Path, steps: int) -> float:
        """verify's measure: the largest per-tensor max|a-b| / max|b| of the saved layers against the reference."""
        import torch

        saved = torch.load(path, weights_only=False)
        reference = self.states(steps)
        if len(saved) != len(reference):
            raise ValueError(f"{path} holds {len(saved)} layers, the reference {len(reference)}")
        worst = 0.0
        for mine, theirs in zip(saved, reference, strict=True):
            for name, tensor in theirs.items():
                diff = (mine[name].double() - tensor.double()).abs().max().item() if tensor.numel() else 0.0
                scale = tensor.double().abs().max().item() if tensor.numel() else 0.0
                worst = max(worst, diff / scale if scale > 0 else diff)
        return worst


# ---- 1. bamboo ---------------------------------------------------------------------------------------------------


def bamboo_kills(args: argparse.Namespace, mode: str, say: Log) -> dict[str, Any]:
    """One `run_verify` per kill; the pause as `bamboo-rc verify` prints it, and verify's max rel diff."""
    from bamboo.rc.faults import KillPoint
    from bamboo.rc.model import GPTSize
    from bamboo.rc.ring import fault_free_ring_stream
    from bamboo.rc.timeouts import CommTimeouts
    from bamboo.rc.verify import DEFAULT_CONFIG, run_verify

    replicas, micro_batches = args.replicas, int(DEFAULT_CONFIG["gradient_accumulation_steps"])
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    timeouts = CommTimeouts(group=30.0, build=30.0, confirm=15.0)
    control = run_verify(1, replicas, args.kill_step + 2, mode, size=GPTSize(layers=args.layers), seed=SEED,
                         timeouts=timeouts, deadline_s=args.kill_timeout)
    say(f"bamboo {mode} without a kill: {args.kill_step + 2} steps, max rel diff {control.max_relative_diff:.3e}")
    for index in range(args.kills):
        victim = index % replicas
        phase = PHASES[index % len(PHASES)]
        stream = [str(i) for i in fault_free_ring_stream(victim, [micro_batches] * replicas, mode)]
        where = stream[min(len(stream) - 1, int(phase * len(stream)))]
        steps = args.kill_step + 2
        result = run_verify(1, replicas, steps, mode, size=GPTSize(layers=args.layers), seed=SEED,
                            timeouts=timeouts, deadline_s=args.kill_timeout,
                            kills=(KillPoint(0, victim, where, step=args.kill_step),))
        killed = [result.kill_times[rank] for rank in result.killed if rank in result.kill_times]
        shadows = [f for f in result.failovers if f.own_pipeline]
        ended = [f.iteration_end for f in shadows if f.iteration_end is not None]
        if not killed or not shadows or not ended:
            errors.append(f"kill {index + 1} ({victim}@{where}): no failover measured; passed={result.passed}")
            say(f"bamboo {mode} kill {index + 1}/{args.kills}: replica {victim} at {where}: no failover measured")
            continue
        at = min(killed)
        row = {"replica": victim, "phase": phase, "instruction": where, "to_resumed_s": max(f.resumed_at for f in shadows) - at,
               "to_step_end_s": max(ended) - at, "max_rel_diff": result.max_relative_diff, "redone": 0,
               "passed": result.passed, "steps": steps}
        rows.append(row)
        say(f"bamboo {mode} kill {index + 1}/{args.kills}: replica {victim} at {where} ({phase:.0%} of its stream): "
            f"pause A {row['to_resumed_s'] * 1e3:.0f} ms, B {row['to_step_end_s'] * 1e3:.0f} ms, "
            f"max rel diff {result.max_relative_diff:.3e}, {'PASS' if result.passed else 'FAIL'}")
    return {"system": f"bamboo-rc {mode}", "rows": rows, "errors": errors,
            "fault_free_diff": control.max_relative_diff}


# ---- 2. torchft --------------------------------------------------------------------------------------------------


def torchft_lighthouse(args: argparse.Namespace) -> None:
    """Run a torchft Lighthouse in this process; write its address to ``--worker-out``; serve until killed."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=args.torchft_join_ms,
                              heartbeat_timeout_ms=args.torchft_heartbeat_ms)
    out = Path(args.worker_out)
    partial = out.with_suffix(".tmp")
    partial.write_text(server.address())
    os.replace(partial, out)
    while True:
        time.sleep(3600)


def torchft_replica(args: argparse.Namespace) -> None:
    """One torchft replica group of one process: the whole decoder, data parallel with its peers, until the step
    in ``stop`` (a file the benchmark writes); then it saves its layers."""
    import datetime

    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel

    group, work = args.worker_index, Path(args.worker_out)
    replica = Replica(args.layers, args.replicas)
    whole = replica.whole

    def state_dict() -> dict[str, Any]:
        return {"state": torch.frombuffer(bytearray(whole.state_bytes()), dtype=torch.uint8)}

    def load_state_dict(state: dict[str, Any]) -> None:
        whole.load_state_bytes(bytes(state["state"].numpy().tobytes()))

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=args.torchft_timeout_s)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"replica{group}", store_addr="127.0.0.1",
                      store_port=store.port, rank=0, world_size=1, lighthouse_addr=args.torchft_lighthouse,
                      hostname="127.0.0.1", timeout=timeout, quorum_timeout=datetime.timedelta(seconds=60),
                      init_sync=False)  # every group starts from the same seeded weights: no healing at step 0
    ddp = DistributedDataParallel(manager, replica.module) if args.torchft_allreduce == "ddp" else None
    records = work / "steps.jsonl"
    # A fault-free start: every group's Manager heartbeats before the first quorum, so the Lighthouse's first
    # quorum waits for all of them (a replacement started after a kill finds the files there).
    (work / f"ready-{group}").write_text(str(os.getpid()))
    _wait(lambda: all((work / f"ready-{g}").exists() for g in range(args.replicas)), 120.0, "every group's start")
    time.sleep(0.5)
    while True:
        stop_file = work / "stop"
        if stop_file.exists() and manager.current_step() >= int(stop_file.read_text()):
            replica.save_layers(work / f"final-{group}.pt")
            _append_record(records, {"replica": group, "final": manager.current_step(), "pid": os.getpid()})
            return
        started = time.time()
        whole.zero_grads()
        manager.start_quorum()
        manager.wait_quorum()
        quorum = time.time()
        step = manager.current_step()
        if ddp is not None:
            loss = replica.share_backward(ddp, step, group, ddp.no_sync)
        else:
            loss = replica.share_backward(replica.module, step, group, None)
            works = [manager.allreduce(p.grad) for p in whole.parameters]
            for handle in works:
                handle.wait()
        committed = manager.should_commit()
        if committed:
            replica.optimizer_step()
        _append_record(records, {"replica": group, "step": step, "start": started, "quorum": quorum,
                                 "end": time.time(), "committed": bool(committed), "loss": loss,
                                 "participants": manager.num_participants()})


def _torchft_probe(python: Path) -> str | None:
    """None when torchft imports from ``python``, else why not."""
    if not python.exists():
        return f"{python} does not exist (torchft is installed only in a separate venv; see --torchft-python)"
    probe = subprocess.run([str(python), "-c", "import torchft, torch; print(torch.__version__)"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    if probe.returncode != 0:
        return f"torchft does not import with {python}: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def _tidy(args: argparse.Namespace, row: dict[str, Any], work: Path) -> None:
    """Remove a run's folder (logs, checkpoints, final states: megabytes) when it was measured, unless
    `--keep-work`; a failed run's folder stays, named in its row."""
    if row.get("outcome") == "ran" and not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
        row.pop("work", None)


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except FileNotFoundError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"


def _kill_torchft_group(args: argparse.Namespace, phase: float, victim: int,
                        records: Callable[[], list[dict[str, Any]]],
                        processes: dict[str, subprocess.Popen[bytes]]) -> float:
    """SIGKILL the victim group's process `phase` of a step after one of its steps ended; the kill's wall time."""
    mine = [x for x in records() if x["replica"] == victim and x["committed"]][-3:]
    duration = sorted(x["end"] - x["start"] for x in mine)[len(mine) // 2]
    target = mine[-1]["end"] + phase * duration
    while target < time.time():  # the record reached us late: the same point of a later step
        target += duration
    time.sleep(max(0.0, target - time.time()))
    at = time.time()
    os.killpg(processes[f"replica{victim}"].pid, signal.SIGKILL)
    processes[f"replica{victim}"].wait()
    return at


def torchft_kill(args: argparse.Namespace, index: int, references: References, say: Log,
                 kill: bool = True) -> dict[str, Any]:
    """One torchft run with one kill: start, warm up, kill a group, restart it, stop, compare (without `kill`:
    the same run without the kill, the control of the max rel diff)."""
    replicas = args.replicas
    victim = index % replicas
    phase = PHASES[index % len(PHASES)]
    work = Path(tempfile.mkdtemp(prefix="bench-dp-torchft-"))
    me = str(Path(__file__).resolve())
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    processes: dict[str, subprocess.Popen[bytes]] = {}
    row: dict[str, Any] = {"replica": victim, "phase": phase, "work": str(work)}

    def start(name: str, argv: list[str]) -> None:
        log = open(work / f"{name}.log", "ab")  # noqa: SIM115
        processes[name] = subprocess.Popen([args.torchft_python, me, *argv], stdout=log, stderr=subprocess.STDOUT,
                                           env=env, cwd=ROOT, start_new_session=True)

    def replica(group: int) -> None:
        start(f"replica{group}", ["--worker", "torchft-replica", "--worker-index", str(group), "--worker-out",
                                  str(work), "--torchft-lighthouse", address, "--layers", str(args.layers),
                                  "--replicas", str(replicas), "--torchft-allreduce", args.torchft_allreduce,
                                  "--torchft-timeout-s", str(args.torchft_timeout_s)])

    def crashed(groups: Sequence[int]) -> str | None:
        for group in groups:
            process = processes[f"replica{group}"]
            if process.poll() is not None and process.returncode != 0:
                return (f"replica group {group} exited with {process.returncode}: "
                        f"{_last_line(work / f'replica{group}.log')}")
        return None

    def records() -> list[dict[str, Any]]:
        return [x for x in _read_records(work / "steps.jsonl") if "step" in x]

    survivors = [group for group in range(replicas) if group != victim]
    try:
        start("lighthouse", ["--worker", "torchft-lighthouse", "--torchft-heartbeat-ms", str(args.torchft_heartbeat_ms),
                             "--torchft-join-ms", str(args.torchft_join_ms), "--worker-out", str(work / "address")])
        _wait(lambda: (work / "address").exists(), 60.0, "the lighthouse")
        address = f"http://127.0.0.1:{(work / 'address').read_text().strip().rsplit(':', 1)[1]}"
        for group in range(replicas):
            replica(group)

        def warmed() -> bool:
            if (problem := crashed(range(replicas))) is not None:
                raise RuntimeError(f"before the kill: {problem}")
            mine = [x for x in records() if x["replica"] == victim and x["committed"] and x["participants"] == replicas]
            return len(mine) >= args.kill_step

        _wait(warmed, args.kill_timeout, f"{args.kill_step} steps of all {replicas} replica groups")
        if kill:
            at = _kill_torchft_group(args, phase, victim, records, processes)
            row["at"] = at

            def resumed() -> list[dict[str, Any]] | None:
                if (problem := crashed(survivors)) is not None:
                    raise RuntimeError(f"after the kill: {problem}")
                firsts = []
                for group in survivors:
                    first = next((x for x in records() if x["replica"] == group and x["committed"]
                                  and x["quorum"] > at), None)
                    if first is None:
                        return None
                    firsts.append(first)
                return firsts

            firsts = _wait(resumed, args.kill_timeout, "the survivors' first committed step after the kill")
            replica(victim)  # a spare takes the group's place at once: it heals from a peer and rejoins
            back = _wait(lambda: crashed(survivors) is None and [x for x in records() if x["replica"] == victim
                                                                  and x["committed"] and x["participants"] == replicas],
                         args.kill_timeout, f"replica group {victim} rejoining")[0]
        stop = max(x["step"] for x in records()) + 3  # (a healing group's first record may carry an older step)
        (work / "stop.tmp").write_text(str(stop))
        os.replace(work / "stop.tmp", work / "stop")
        for group in range(replicas):
            process = processes[f"replica{group}"]
            try:
                process.wait(timeout=args.kill_timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"replica group {group} did not stop at step {stop}") from None
        if (problem := crashed(range(replicas))) is not None:
            raise RuntimeError(f"at the end: {problem}")
        finals = {x["replica"]: x["final"] for x in _read_records(work / "steps.jsonl") if "final" in x}
        if any(finals.get(group) != stop for group in range(replicas)):
            raise RuntimeError(f"the groups stopped at steps {finals}, not all at {stop}")
        compared = survivors if kill else range(replicas)
        diff = max(references.max_relative_diff(work / f"final-{group}.pt", stop) for group in compared)
        every = records()
        short = sorted({x["step"] for x in every if x["committed"] and x["participants"] < replicas})
        row.update({"steps": stop, "max_rel_diff": diff, "short_steps": len(short), "outcome": "ran"})
        if not kill:
            say(f"torchft ({args.torchft_allreduce}) without a kill: {stop} steps, max rel diff {diff:.3e}")
            return row
        discarded = sum(1 for group in survivors for x in every if x["replica"] == group and not x["committed"]
                        and at - 1.0 < x["end"] <= max(f["end"] for f in firsts))
        row.update({"to_resumed_s": max(f["quorum"] for f in firsts) - at,
                    "to_step_end_s": max(f["end"] for f in firsts) - at, "redone": discarded,
                    "rejoin_s": back["end"] - at})
        say(f"torchft ({args.torchft_allreduce}) kill {index + 1}/{args.kills}: replica group {victim} "
            f"({phase:.0%} into a step): pause A {row['to_resumed_s']:.3f} s, B {row['to_step_end_s']:.3f} s, "
            f"{discarded} steps discarded, {len(short)} steps committed without a group's share, "
            f"max rel diff {diff:.3e}")
    except Exception as error:  # recorded for this kill; the next kill is a fresh run
        row["outcome"] = f"{type(error).__name__}: {error}"
        say(f"torchft ({args.torchft_allreduce}) kill {index + 1}/{args.kills}: {row['outcome']}")
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        _tidy(args, row, work)
    return row


def torchft_kills(args: argparse.Namespace, variant: str, references: References, say: Log) -> dict[str, Any]:
    name = f"torchft 0.2.0 ({'DDP wrapper' if variant == 'ddp' else 'Manager.allreduce'})"
    problem = _torchft_probe(Path(args.torchft_python))
    if problem is not None:
        return {"system": name, "status": f"not run: {problem}", "rows": [], "errors": []}
    args = argparse.Namespace(**{**vars(args), "torchft_allreduce": variant})
    control = torchft_kill(args, 0, references, say, kill=False)
    outcomes = [torchft_kill(args, index, references, say) for index in range(args.kills)]
    return {"system": name, "status": "ran", "fault_free_diff": control.get("max_rel_diff", math.nan),
            "rows": [row for row in outcomes if row.get("outcome") == "ran"],
            "errors": [f"kill {i + 1}: {row['outcome']} (logs: {row.get('work')})" for i, row in enumerate(outcomes)
                       if row.get("outcome") != "ran"],
            "heartbeat_ms": args.torchft_heartbeat_ms}


# ---- 3. torchrun restart from a checkpoint ----------------------------------------------------------------------


def torchrun_worker(args: argparse.Namespace) -> None:
    """One torchrun worker: DDP over gloo, a checkpoint every K steps by rank 0, resume from the latest."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    work = Path(args.worker_out)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    replica = Replica(args.layers, args.replicas)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.replicas:
        raise RuntimeError(f"torchrun gave {world} workers, the benchmark wants {args.replicas}")
    (work / f"pid-{rank}-{restart}").write_text(str(os.getpid()))
    first = 0
    latest = work / "ckpt-latest"
    if latest.exists():
        saved = torch.load(latest, weights_only=False)
        replica.whole.load_state_bytes(saved["state"])
        first = int(saved["step"])
    model = DistributedDataParallel(replica.module)
    records = work / "steps.jsonl"
    for step in range(first, args.steps):
        started = time.time()
        loss = replica.share_backward(model, step, rank, model.no_sync)
        replica.optimizer_step()
        saved_at = None
        if rank == 0 and (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
            partial = work / "ckpt.tmp"
            torch.save({"state": replica.whole.state_bytes(), "step": step + 1}, partial)
            os.replace(partial, latest)
            saved_at = step + 1
        _append_record(records, {"rank": rank, "step": step, "start": started, "end": time.time(), "loss": loss,
                                 "restart": restart, "checkpoint": saved_at})
    if rank == 0:
        replica.save_layers(work / "final.pt")
    dist.destroy_process_group()
    _append_record(records, {"rank": rank, "done": args.steps, "restart": restart})


def torchrun_kill(args: argparse.Namespace, index: int, references: References, say: Log,
                  kill: bool = True) -> dict[str, Any]:
    """One torchrun run with one kill of a worker: the agent restarts them all from the last checkpoint
    (without `kill`: the same run without the kill, the control of the max rel diff)."""
    replicas = args.replicas
    victim = index % replicas
    phase = PHASES[index % len(PHASES)]
    kill_step = args.kill_step + index % args.ckpt_every  # the kills land at every distance from a checkpoint
    steps = kill_step + args.ckpt_every + 2
    work = Path(tempfile.mkdtemp(prefix="bench-dp-torchrun-"))
    me = str(Path(__file__).resolve())
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    row: dict[str, Any] = {"replica": victim, "phase": phase, "kill_step": kill_step, "steps": steps,
                           "work": str(work)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
               str(replicas), "--max-restarts", "10", "--monitor-interval", "0.1", me, "--worker", "torchrun-worker",
               "--worker-out", str(work), "--layers", str(args.layers), "--replicas", str(replicas), "--steps",
               str(steps), "--ckpt-every", str(args.ckpt_every)]
    log = open(work / "torchrun.log", "ab")  # noqa: SIM115
    agent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                             start_new_session=True)

    def records() -> list[dict[str, Any]]:
        return [x for x in _read_records(work / "steps.jsonl") if "step" in x]

    def finish() -> None:
        """Wait for every worker to finish the last step; then for the agent (noted when it hangs at exit)."""
        def done() -> bool:
            if agent.poll() is not None and agent.returncode != 0:
                raise RuntimeError(f"torchrun exited with {agent.returncode}: {_last_line(work / 'torchrun.log')}")
            ranks = {x["rank"] for x in _read_records(work / "steps.jsonl") if x.get("done") == steps}
            return len(ranks) == replicas or agent.poll() == 0

        _wait(done, args.kill_timeout, f"torchrun's {replicas} workers finishing step {steps - 1}", poll_s=0.1)
        try:
            agent.wait(timeout=30.0)
            row["agent_exit"] = agent.returncode
        except subprocess.TimeoutExpired:
            row["agent_exit"] = "did not exit 30 s after its workers finished (killed)"
        if not (work / "final.pt").exists():
            raise RuntimeError(f"no final.pt: {_last_line(work / 'torchrun.log')}")

    try:
        if not kill:
            finish()
            row.update({"max_rel_diff": references.max_relative_diff(work / "final.pt", steps), "outcome": "ran"})
            say(f"torchrun without a kill: {steps} steps, max rel diff {row['max_rel_diff']:.3e}")
            return row

        def before() -> list[dict[str, Any]]:
            if agent.poll() is not None:
                raise RuntimeError(f"torchrun exited with {agent.returncode} before the kill: "
                                   f"{_last_line(work / 'torchrun.log')}")
            return [x for x in records() if x["rank"] == victim and x["step"] == kill_step - 1]

        last = _wait(before, args.kill_timeout, f"step {kill_step - 1} of worker {victim}")[0]
        recent = [x["end"] - x["start"] for x in records() if x["rank"] == victim][-3:]
        duration = sorted(recent)[len(recent) // 2]
        target = last["end"] + phase * duration
        while target < time.time():
            target += duration
        time.sleep(max(0.0, target - time.time()))
        pid = int((work / f"pid-{victim}-0").read_text())
        at = time.time()
        os.kill(pid, signal.SIGKILL)
        row["at"] = at
        finish()
        every = records()
        after = [x for x in every if x["restart"] > 0]
        if not after:
            raise RuntimeError("no step after a restart: the kill restarted nothing")
        first_start = min(x["start"] for x in after)
        first_step = min(x["step"] for x in after)
        first_end = max(x["end"] for x in after if x["step"] == first_step)
        completed = max(x["step"] for x in every if x["restart"] == 0 and x["rank"] == 0) + 1
        row.update({"to_resumed_s": first_start - at, "to_step_end_s": first_end - at,
                    "redone": completed - first_step, "restarts": max(x["restart"] for x in every),
                    "resumed_from": first_step, "max_rel_diff": references.max_relative_diff(work / "final.pt", steps),
                    "outcome": "ran"})
        say(f"torchrun kill {index + 1}/{args.kills}: worker {victim} in step {kill_step} ({phase:.0%} into it): "
            f"pause A {row['to_resumed_s']:.3f} s, B {row['to_step_end_s']:.3f} s, resumed from step {first_step} "
            f"({row['redone']} steps redone), max rel diff {row['max_rel_diff']:.3e}")
    except Exception as error:
        row["outcome"] = f"{type(error).__name__}: {error}"
        say(f"torchrun kill {index + 1}/{args.kills}: {row['outcome']}")
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        log.close()
        _tidy(args, row, work)
    return row


def torchrun_kills(args: argparse.Namespace, references: References, say: Log) -> dict[str, Any]:
    control = torchrun_kill(args, 0, references, say, kill=False)
    outcomes = [torchrun_kill(args, index, references, say) for index in range(args.kills)]
    return {"system": f"torchrun restart, ckpt every {args.ckpt_every}", "status": "ran",
            "fault_free_diff": control.get("max_rel_diff", math.nan),
            "rows": [row for row in outcomes if row.get("outcome") == "ran"],
            "errors": [f"kill {i + 1}: {row['outcome']} (logs: {row.get('work')})" for i, row in enumerate(outcomes)
                       if row.get("outcome") != "ran"]}


# ---- the table ---------------------------------------------------------------------------------------------------


def summarize(system: dict[str, Any]) -> dict[str, Any]:
    rows = system["rows"]
    resumed = [row["to_resumed_s"] for row in rows]
    ends = [row["to_step_end_s"] for row in rows]
    return {"system": system["system"], "kills": len(rows), "failed": len(system.get("errors", [])),
            "a50": percentile(resumed, 50), "a99": percentile(resumed, 99), "b50": percentile(ends, 50),
            "b99": percentile(ends, 99), "diff": max((row["max_rel_diff"] for row in rows), default=math.nan),
            "fault_free_diff": system.get("fault_free_diff", math.nan),
            "redone": sum(row["redone"] for row in rows)}


def print_table(systems: Sequence[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    summaries = [summarize(system) for system in systems]
    base = summaries[0]
    print()
    print(f"Pure data parallelism, P = 1, D = {args.replicas}, the example decoder ({args.layers} blocks), one kill -9 "
          f"per run. Pause A: kill -> every survivor resumed (bamboo) / survivors' first committed quorum (torchft) / "
          f"first step after the restart started (torchrun); B: kill -> end of that step. Seconds.")
    header = (f"{'system':<36} {'kills':>5} {'A p50':>7} {'A p99':>7} {'B p50':>7} {'B p99':>7} {'max rel diff':>12} "
              f"{'no kill':>9} {'redone':>6} {'A x':>7} {'B x':>7}")
    print(header)
    for system, summary in zip(systems, summaries, strict=True):
        if system.get("status", "ran") != "ran":
            print(f"{system['system']:<36} {system['status']}")
            continue
        if not system["rows"]:
            print(f"{system['system']:<36} no kill measured: all {summary['failed']} runs failed (below); its run "
                  f"without a kill: max rel diff {summary['fault_free_diff']:.1e}")
            continue
        kills = f"{summary['kills']}" + (f"+{summary['failed']}!" if summary["failed"] else "")
        a_ratio = summary["a50"] / base["a50"] if base["a50"] > 0 else math.nan
        b_ratio = summary["b50"] / base["b50"] if base["b50"] > 0 else math.nan
        print(f"{system['system']:<36} {kills:>5} {summary['a50']:>7.3f} {summary['a99']:>7.3f} {summary['b50']:>7.3f} "
              f"{summary['b99']:>7.3f} {summary['diff']:>12.3e} {summary['fault_free_diff']:>9.1e} "
              f"{summary['redone']:>6} {a_ratio:>6.1f}x "
              f"{b_ratio:>6.1f}x")
    print(f"(max rel diff: the largest over the kills; no kill: the same system's run without a kill, its "
          f"numerical distance from the reference; ratios: each system's p50 over {base['system']}'s p50, same "
          f"run; kills N+F!: F kills of that system gave no measurement, listed below)")
    for system in systems:
        for error in system.get("errors", []):
            print(f"  {system['system']}: {error}")
        hung = [row["agent_exit"] for row in system["rows"] if row.get("agent_exit", 0) != 0]
        if hung:
            print(f"  {system['system']}: the torchrun agent, after its workers finished: {hung}")
        short = [row.get("short_steps", 0) for row in system["rows"] if "short_steps" in row]
        if short:
            print(f"  {system['system']}: steps committed without the killed group's share, per kill: {short} "
                  f"(Lighthouse heartbeat timeout {system.get('heartbeat_ms')} ms)")
    return summaries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=5, help="kills per system, one run each (default 5)")
    parser.add_argument("--replicas", type=int, default=3, help="data-parallel replicas D (default 3)")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks of the example model (default 4)")
    parser.add_argument("--kill-step", type=int, default=3,
                        help="the step (0-based) the kills land in; torchrun's move on by up to K-1 (default 3)")
    parser.add_argument("--modes", default="lflb,eflb",
                        help="bamboo's redundancy modes, comma separated; the first is the ratios' base "
                             "(default lflb,eflb)")
    parser.add_argument("--ckpt-every", type=int, default=4, help="torchrun's checkpoint interval K in steps (default 4)")
    parser.add_argument("--torchft-python", default="/work/bench-venv/bin/python",
                        help="a Python with torchft 0.2.0 and this repository's packages (default %(default)s)")
    parser.add_argument("--torchft-variants", default="ddp,manager",
                        help="torchft's gradient sync, comma separated, one row each: its DistributedDataParallel "
                             "wrapper (ddp) and Manager.allreduce of each gradient (manager) (default ddp,manager)")
    parser.add_argument("--torchft-allreduce", choices=("ddp", "manager"), default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--torchft-heartbeat-ms", type=int, default=1000,
                        help="the Lighthouse's heartbeat timeout (default 1000 ms; torchft's own default is 5000)")
    parser.add_argument("--torchft-join-ms", type=int, default=60000, help="the Lighthouse's join timeout (ms)")
    parser.add_argument("--torchft-timeout-s", type=float, default=10.0,
                        help="the Manager's and its gloo group's operation timeout (default 10 s)")
    parser.add_argument("--kill-timeout", type=float, default=120.0,
                        help="seconds any one run, or one wait inside it, may take before it counts as failed "
                             "(default 120)")
    parser.add_argument("--skip", nargs="*", default=[], choices=("torchft", "torchrun"), help="baselines to leave out")
    parser.add_argument("--json", type=Path, default=None, help="also write every measurement to this JSON file")
    parser.add_argument("--keep-work", action="store_true",
                        help="keep every baseline run's folder under the temporary directory (default: only failed "
                             "runs' folders are kept, and named)")
    parser.add_argument("--worker", choices=("torchft-lighthouse", "torchft-replica", "torchrun-worker"),
                        default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--torchft-lighthouse", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "torchft-lighthouse":
        torchft_lighthouse(args)
        return 0
    if args.worker == "torchft-replica":
        torchft_replica(args)
        return 0
    if args.worker == "torchrun-worker":
        torchrun_worker(args)
        return 0
    if args.kills < 1:
        parser.error(f"--kills must be >= 1, got {args.kills}")
    if args.replicas < 2:
        parser.error(f"--replicas must be >= 2 (a kill needs a survivor), got {args.replicas}")
    if args.kill_step < 1:
        parser.error(f"--kill-step must be >= 1 (a step before the kill measures the step time), got {args.kill_step}")
    if args.ckpt_every < 1:
        parser.error(f"--ckpt-every must be >= 1, got {args.ckpt_every}")
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    bad = [mode for mode in modes if mode not in ("lflb", "eflb", "efeb")]
    if not modes or bad:
        parser.error(f"--modes must name lflb, eflb or efeb, got {args.modes!r}")
    variants = [variant.strip() for variant in args.torchft_variants.split(",") if variant.strip()]
    if not variants or any(variant not in ("ddp", "manager") for variant in variants):
        parser.error(f"--torchft-variants must name ddp or manager, got {args.torchft_variants!r}")
    say = Log()
    references = References(args.layers, args.replicas)
    systems = [bamboo_kills(args, mode, say) for mode in modes]
    if "torchft" not in args.skip:
        systems += [torchft_kills(args, variant, references, say) for variant in variants]
    if "torchrun" not in args.skip:
        systems.append(torchrun_kills(args, references, say))
    summaries = print_table(systems, args)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if not k.startswith("worker")},
                                         "systems": systems, "summaries": summaries}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
