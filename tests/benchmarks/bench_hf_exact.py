"""Benchmark: Hugging Face models through a kill and a joiner under ``bamboo-launch run --verify``, then exported.

Run: `.venv/bin/python tests/benchmarks/bench_hf_exact.py` (add `--help` for the flags). Not collected by
pytest; one run of the matrix takes several minutes per row.

Each row is the README's command (`packages/bamboo-launch/examples/train_hf.py` on a token file of the Python
standard library's source): five nodes, two pipelines of two stages and one on standby; the trace kills node1
`--kill-at` seconds into training (its shadow takes the stage over), the standby node joins (a
reconfiguration that moves the stage state to it); `--verify` trains the fault-free single-process reference
in the same precision and compares the final parameters (max relative difference). Then `bamboo-launch export
--format hf` writes the folder, reloads it with `AutoModelForCausalLM.from_pretrained` and compares its logits
with bamboo's (max abs difference). The baseline of the exactness figure is the reference, trained in the same
run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "packages" / "bamboo-launch" / "examples"


def run_row(model: str, precision: str, steps: int, kill_at: float, work: Path) -> dict[str, Any]:
    """One row: the run with its kill and joiner, ``--verify``, and the export."""
    tokens = work / "stdlib.bin"
    trace = work / "trace.csv"
    trace.write_text("".join(f"0,add,node{k}\n" for k in range(1, 6)) + f"{int(kill_at * 1000)},remove,node2\n")
    run_dir = work / f"{model}-{precision}"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "bamboo.launch", "run", "--nodes", "5", "--stages", "2", "--pipelines", "2",
         "--steps", str(steps), "--zones", "a,b,c", "--time-scale", "1", "--preemptions", str(trace),
         "--run-dir", str(run_dir), "--verify", "--json", "--no-live", "--timeout", "1500",
         "--preload", f"transformers.models.{model}.modeling_{model}",
         "--", str(EXAMPLES / "train_hf.py"), "--model", model, "--precision", precision, "--tokens", str(tokens)],
        capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    lines = done.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    row: dict[str, Any] = {
        "model": model, "precision": precision, "exit_status": done.returncode, "seconds": round(seconds, 1),
        "verify": report.get("verify", "not run: " + (done.stderr.strip().splitlines() or ["no output"])[-1]),
        "max_relative_diff": report.get("max_relative_diff"), "compared_steps": report.get("compared_steps"),
        "failovers": report.get("failovers"), "reconfigurations": report.get("reconfigurations"),
    }
    if done.returncode == 0:
        export = subprocess.run([sys.executable, "-m", "bamboo.launch", "export", str(run_dir), "--format", "hf",
                                 "-o", str(work / f"{model}-{precision}-hf")], capture_output=True, text=True,
                                check=False)
        found = re.search(r"max abs diff ([0-9.e+-]+)", export.stdout)
        row["export_logits_max_abs_diff"] = float(found.group(1)) if found else None
        row["export_exit_status"] = export.returncode
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"],
                        help="architectures (default: both)")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "fp16"], choices=["fp32", "bf16", "fp16"],
                        help="precisions (default: all three)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (default: %(default)s)")
    parser.add_argument("--kill-at", type=float, default=3.0, help="seconds into training when node1 is killed "
                        "(default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bamboo-bench-hf-") as folder:
        work = Path(folder)
        subprocess.run([sys.executable, str(EXAMPLES / "stdlib_tokens.py"), str(work / "stdlib.bin")], check=True,
                       capture_output=True)
        print(f"{'model':<6} {'precision':<9} {'verify':<8} {'max rel diff':>12} {'failovers':>9} "
              f"{'reconfigurations':>16} {'export logits diff':>18} {'seconds':>8}", flush=True)
        for model in args.models:
            for precision in args.precisions:
                row = run_row(model, precision, args.steps, args.kill_at, work)
                rows.append(row)
                print(f"{model:<6} {precision:<9} {str(row['verify'])[:8]:<8} {row['max_relative_diff']!s:>12} "
                      f"{row['failovers']!s:>9} {row['reconfigurations']!s:>16} "
                      f"{row.get('export_logits_max_abs_diff')!s:>18} {row['seconds']:>8}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"steps": args.steps, "kill_at_s": args.kill_at, "rows": rows}, indent=2) + "\n")
    return 0 if all(row["exit_status"] == 0 and row.get("export_exit_status") == 0 for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
