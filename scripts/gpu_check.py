"""The prepared GPU check: one run on one GPU that prints one table (``scripts/gpu-check.sh``, which runs this).

Steps, each a group of rows of the table (what was measured, the goal, and whether it was met):

1. ``environment``: torch, its CUDA build, the GPU;
2. ``verify``: ``bamboo-rc verify`` on the device with P = 2 and P = 4, D = 2 (2P processes sharing the GPU),
   every redundancy mode, a kill -9 mid-iteration in every mode that survives one, each against a single-process
   reference on the same device with deterministic algorithms: the max relative difference (goal 0.0) and
   replicas bit-equal;
3. ``pause``: each kill's failover pause, from the kill to every survivor resumed (goal at most 0.25 s);
4. ``overhead``: ``tests/benchmarks/bench_rc.py --device``: the step time of ``none``, ``lflb``, ``eflb``, ``efeb``
   and DeepSpeed's ``PipelineEngine`` where it runs on the same GPU, on a model whose steps take 50 ms or more:
   eflb against none (goal at most +10%);
5. ``memory``: the same runs' peak GPU memory per mode, the FRC stash's bytes swapped per step and held on the
   GPU; eager FRC's extra peak over lflb's against the replica's activations of a step (goal at most 5%);
6. ``transport``: a message's staging copies through pinned memory against gloo's transfer of the same bytes;
7. ``cuda tests``: the tests marked ``cuda`` (``pytest -m cuda``);
8. ``transformers``: a small GPT-2 through ``bamboo.rc.from_transformers``, where that exists: its loss against
   the ``transformers`` model's own on the device.

``--dry-run`` runs the same steps on the CPU with the smallest sizes (``tests/test_gpu_check.py`` does, in
``make test``, so that this script cannot rot). This process never starts CUDA: verify forks its workers from it,
and whatever uses the GPU runs in a child.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # deepspeed is imported for its LayerSpec only (the workers)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))

import torch  # noqa: E402
from bamboo.rc.device import cuda_device_count, resolve_device  # noqa: E402
from bamboo.rc.faults import KillPoint  # noqa: E402
from bamboo.rc.model import GPTSize  # noqa: E402
from bamboo.rc.timeouts import CommTimeouts  # noqa: E402
from bamboo.rc.verify import DEFAULT_CONFIG, run_verify  # noqa: E402

Row = dict[str, str]
"""One line of the table: ``step``, ``what``, ``measured``, ``goal``, ``ok`` (``yes``, ``NO`` or ``-``)."""

PAUSE_GOAL_S = 0.25
OVERHEAD_GOAL = 0.10
STASH_GOAL = 0.05
LONG_STEP_MS = 50.0
TIMEOUTS = CommTimeouts(group=60.0, build=120.0, confirm=60.0)
KILL = ("1@1F2", 1, 0, "1F2", 1)
"""Where each kill lands: stage 1 of pipeline 0 at its forward of microbatch 2, in step 1 (mid-iteration)."""


def _sizes(dry: bool) -> dict[str, Any]:
    """What each step runs: the full check's sizes, or the dry run's smallest."""
    if dry:
        return {"verify": [(2, 1, "none", False), (2, 1, "eflb", True)], "steps": 2, "judge_time": False,
                "model": GPTSize(layers=2, width=16, heads=2, sequence=8),
                "bench": ["--micro-batches", "2", "--steps", "2", "--repeats", "1", "--layers", "1", "--width", "32",
                          "--heads", "2", "--sequence", "16", "--micro-batch-size", "2",
                          "--variants", "deepspeed", "none", "eflb", "--torch-adam"],
                "message_mib": 1}
    matrix = [(2, 2, mode, False) for mode in ("none", "lflb", "eflb", "efeb")] + [(2, 2, "eflb", True)]
    matrix += [(4, 2, "none", False)] + [(4, 2, mode, True) for mode in ("lflb", "eflb", "efeb")]
    return {"verify": matrix, "steps": 3, "model": GPTSize(), "judge_time": True,
            "bench": ["--micro-batches", "8", "--steps", "6", "--repeats", "2", "--layers", "8", "--width", "1024",
                      "--heads", "16", "--sequence", "256", "--micro-batch-size", "8",
                      "--variants", "deepspeed", "none", "lflb", "eflb", "efeb"],
            "message_mib": 16}


def _ok(condition: bool) -> str:
    return "yes" if condition else "NO"


def _timed(condition: bool, sizes: dict[str, Any]) -> str:
    """The verdict on a goal of time or memory: judged on the GPU only (a dry run's sizes say nothing of it)."""
    return _ok(condition) if sizes["judge_time"] else "-"


# ---------------------------------------------------------------------------------- 1. the environment
def environment(device: str) -> list[Row]:
    gpu = "none"
    if device != "cpu":
        gpu = _in_child(lambda: torch.cuda.get_device_name(resolve_device(device)))
    return [{"step": "environment", "what": "torch, CUDA build, GPUs, device",
             "measured": f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, {cuda_device_count()} "
                         f"GPU(s) ({gpu}), device {device}, python {platform.python_version()}",
             "goal": "-", "ok": "-"}]


# ---------------------------------------------------------------------------------- 2 and 3. verify, pause
def verify(device: str, sizes: dict[str, Any], say: Callable[[str], None]) -> list[Row]:
    rows: list[Row] = []
    pauses: list[float] = []
    for stages, pipelines, mode, kill in sizes["verify"]:
        what = f"P={stages} D={pipelines} {mode}" + (f", kill -9 of {KILL[0]}/{KILL[4]}" if kill else "")
        say(f"verify {what}")
        kills = (KillPoint(KILL[1], KILL[2], KILL[3], KILL[4]),) if kill else ()
        try:
            result = run_verify(stages, pipelines, sizes["steps"], mode, size=sizes["model"], config=dict(DEFAULT_CONFIG),
                                timeouts=TIMEOUTS, kills=kills, device=device)
        except Exception as exc:  # one row says what went wrong; the other steps still run
            rows.append({"step": "verify", "what": what, "measured": f"error: {exc}", "goal": "0.0", "ok": "NO"})
            continue
        peak = max((m.get("device_peak_bytes", 0) for m in result.memory.values()), default=0)
        measured = (f"max rel diff {result.max_relative_diff:.1e}, replicas "
                    f"{'bit-equal' if result.replicas_bit_equal else 'NOT bit-equal'}, {result.seconds:.0f} s"
                    + (f", GPU peak {peak / 2**20:.0f} MiB/worker" if peak else ""))
        rows.append({"step": "verify", "what": what, "measured": measured, "goal": "0.0, bit-equal",
                     "ok": _ok(result.passed and result.max_relative_diff == 0.0)})
        for failover in result.failovers:
            pause = result.pause_seconds(failover) if failover.cut is not None else None
            if pause is not None:
                pauses.append(pause[0])
                rows.append({"step": "pause", "what": what, "measured": f"{1e3 * pause[0]:.0f} ms to every survivor "
                             f"resumed" + (f", {1e3 * pause[1]:.0f} ms to the failed step's end" if pause[1] else ""),
                             "goal": f"<= {PAUSE_GOAL_S} s", "ok": _timed(pause[0] <= PAUSE_GOAL_S, sizes)})
                break
    if not pauses:
        rows.append({"step": "pause", "what": "every kill", "measured": "no pause measured", "goal": "-", "ok": "NO"})
    return rows


# ---------------------------------------------------------------------------------- 4 and 5. overhead, memory
def bench(device: str, sizes: dict[str, Any], say: Callable[[str], None]) -> list[Row]:
    say("bench_rc " + " ".join(sizes["bench"]))
    with tempfile.TemporaryDirectory(prefix="bamboo-gpu-check-") as folder:
        out = Path(folder) / "bench.json"
        done = subprocess.run([sys.executable, str(ROOT / "tests/benchmarks/bench_rc.py"), "--device", device,
                               *sizes["bench"], "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0 or not out.exists():
            last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
            return [{"step": "overhead", "what": "bench_rc.py", "measured": f"error: {last}", "goal": "-", "ok": "NO"}]
        results = json.loads(out.read_text())
    rows: list[Row] = []
    for m, measured in results.items():
        if m.isdigit():  # one entry per M; the others describe the run
            rows += _overhead_rows(m, measured["variants"], sizes)
            rows += _memory_rows(m, measured["variants"], device)
    return rows


def _overhead_rows(m: str, variants: dict[str, Any], sizes: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    none = variants.get("none", {}).get("ms_per_iteration")
    for variant, row in variants.items():
        if "error" in row:
            rows.append({"step": "overhead", "what": f"M={m} {variant}", "measured": f"cannot run here: {row['error']}",
                         "goal": "-", "ok": "-"})
            continue
        against = row["overhead_vs_none_pct"] / 100 if row.get("overhead_vs_none_pct") is not None else None
        measured = f"{row['ms_per_iteration']:.1f} ms/step" + (f", {against:+.1%} vs none" if against is not None
                                                                  and variant != "none" else "")
        goal, ok = "-", "-"
        if variant == "eflb" and against is not None and none is not None:
            long_enough = none >= LONG_STEP_MS
            goal = f"<= +{OVERHEAD_GOAL:.0%} vs none" + ("" if long_enough else f" (steps under {LONG_STEP_MS:g} ms)")
            ok = _timed(against <= OVERHEAD_GOAL, sizes) if long_enough else "-"
        rows.append({"step": "overhead", "what": f"M={m} {variant}", "measured": measured, "goal": goal, "ok": ok})
    return rows


def _memory_rows(m: str, variants: dict[str, Any], device: str) -> list[Row]:
    if device == "cpu":
        return [{"step": "memory", "what": f"M={m} every mode", "measured": "n/a on the CPU (no GPU memory)",
                 "goal": "-", "ok": "-"}]
    rows: list[Row] = []
    for variant, row in variants.items():
        if "error" in row:
            continue
        rows.append({"step": "memory", "what": f"M={m} {variant}",
                     "measured": f"GPU peak {row['device_peak_bytes'] / 2**20:.0f} MiB, stash swapped "
                                 f"{row['swapped_bytes_per_step'] / 2**20:.1f} MiB/step, on the GPU at most "
                                 f"{row['stash_device_peak_bytes'] / 2**20:.1f} MiB", "goal": "-", "ok": "-"})
    eflb, lflb = variants.get("eflb", {}), variants.get("lflb", {})
    if "device_peak_bytes" in eflb and "device_peak_bytes" in lflb and eflb["swapped_bytes_per_step"]:
        extra = (eflb["device_peak_bytes"] - lflb["device_peak_bytes"]) / eflb["swapped_bytes_per_step"]
        rows.append({"step": "memory", "what": f"M={m} eager FRC's stash on the GPU",
                     "measured": f"eflb's peak over lflb's: {extra:.1%} of the replica's activations of a step",
                     "goal": f"<= {STASH_GOAL:.0%}", "ok": _ok(extra <= STASH_GOAL)})
    return rows


# ---------------------------------------------------------------------------------- 6. the transport
def transport(device: str, sizes: dict[str, Any], say: Callable[[str], None]) -> list[Row]:
    """One message of ``message_mib`` MiB: gloo's transfer between two processes (host memory, 1 MiB chunks, as the
    runtime sends), and on a GPU the two staging copies (device to pinned host, pinned host to device)."""
    from gpu_check_probes import gloo_seconds, staging_seconds

    mib = sizes["message_mib"]
    say(f"transport: a {mib} MiB message")
    gloo = gloo_seconds(mib)
    if device == "cpu":
        measured, share = f"gloo {mib / gloo:.0f} MiB/s; no staging on the CPU (the message is sent as it is)", 0.0
    else:
        staging = _in_child(lambda: staging_seconds(mib, device))
        share = staging / (staging + gloo)
        measured = (f"gloo {mib / gloo:.0f} MiB/s, staging copies {mib / staging:.0f} MiB/s: {share:.1%} of a "
                    f"staged transfer")
    return [{"step": "transport", "what": f"{mib} MiB message, gloo over pinned host buffers", "measured": measured,
             "goal": "-", "ok": "-"}]


# ---------------------------------------------------------------------------------- 7 and 8. tests, transformers
def cuda_tests(say: Callable[[str], None]) -> list[Row]:
    say("pytest -m cuda")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-n", "0",
                           "packages/bamboo-rc/tests/test_device.py", "-k", "not fails_over"],
                          capture_output=True, text=True, cwd=ROOT)
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    counts = dict((word, int(number)) for number, word in re.findall(r"(\d+) (passed|failed|skipped|error)", summary))
    ok = "-" if not counts.get("passed") and not counts.get("failed") else _ok(done.returncode == 0)
    return [{"step": "cuda tests", "what": "pytest -m cuda (the kill runs are the verify rows)",
             "measured": summary.strip("= "), "goal": "all pass", "ok": ok}]


def transformers_model(device: str, say: Callable[[str], None]) -> list[Row]:
    import bamboo.rc

    row = {"step": "transformers", "what": "GPT-2 (2 blocks) through bamboo.rc.from_transformers", "goal": "<= 1e-6 rel"}
    if not hasattr(bamboo.rc, "from_transformers"):
        return [{**row, "measured": "skipped: bamboo.rc.from_transformers has not landed", "ok": "-"}]
    say("transformers: GPT-2 loss, ours against the model's own")
    from gpu_check_probes import transformers_difference

    try:
        difference = _in_child(lambda: transformers_difference(device))
    except RuntimeError as exc:
        return [{**row, "measured": f"error: {exc}", "ok": "NO"}]
    return [{**row, "measured": f"loss rel diff {difference:.1e}", "ok": _ok(difference <= 1e-6)}]


# ---------------------------------------------------------------------------------- running and printing
def _in_child(work: Callable[[], Any]) -> Any:
    """``work()`` in a forked child (which may start CUDA; this process must not), its JSON result handed back."""
    with tempfile.TemporaryDirectory(prefix="bamboo-gpu-check-child-") as folder:
        path = Path(folder) / "result.json"
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                path.write_text(json.dumps({"result": work()}))
                code = 0
            except BaseException as exc:
                path.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}))
                traceback.print_exc()
            finally:
                os._exit(code)
        os.waitpid(pid, 0)
        answer = json.loads(path.read_text()) if path.exists() else {"error": "the child died without an answer"}
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["result"]


def table(rows: list[Row]) -> str:
    lines = ["| step | what | measured | goal | ok |", "|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['what']} | {r['measured']} | {r['goal']} | {r['ok']} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="the same steps on the CPU with the smallest sizes, in seconds (what make test runs)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows, the command and the machine here")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and cuda_device_count() == 0:
        print(f"gpu-check: no GPU visible to torch {torch.__version__} (CUDA build {torch.version.cuda or 'none'}); "
              "install torch==2.13.0's CUDA build into the venv, or run --dry-run", file=sys.stderr)
        return 2
    sizes = _sizes(args.dry_run)
    started = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    rows = environment(device)
    rows += verify(device, sizes, say)
    rows += bench(device, sizes, say)
    rows += transport(device, sizes, say)
    rows += cuda_tests(say)
    rows += transformers_model(device, say)
    print(table(rows))
    seconds = time.monotonic() - started
    print(f"\n{len(rows)} rows in {seconds:.0f} s; {sum(r['ok'] == 'NO' for r in rows)} goal(s) not met")
    if args.json:
        args.json.write_text(json.dumps({
            "command": "scripts/gpu-check.sh" + (" --dry-run" if args.dry_run else ""),
            "machine": rows[0]["measured"], "date": datetime.date.today().isoformat(), "seconds": seconds,
            "results": rows}, indent=2))
    return 1 if any(r["ok"] == "NO" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
