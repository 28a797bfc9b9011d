"""Benchmark: what periodic checkpoints cost the training loop, synchronous against asynchronous.

Runs the same CPU training loop (an MLP, Adam) three ways in one process, interleaved over
rounds, and prints the mean step time of each (checkpoint steps included, so it is the loop's
total time per step) and its ratio against the loop without checkpoints, measured in the same
run:

- ``none``: no checkpoints (the baseline);
- ``sync``: ``write_checkpoint`` called in the loop (serialise + checksum + fsync + rename);
- ``async``: ``AsyncCheckpointer.maybe_save`` (a snapshot in the loop, the rest in a thread).

Also prints the time the loop spends inside the checkpoint call itself (``save`` for async,
the whole write for sync). Run: ``.venv/bin/python tests/benchmarks/bench_checkpoint.py``
(``--help`` for the sizes). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bamboo.rc import AsyncCheckpointer, write_checkpoint

MODES = ("none", "sync", "async")


def build(width: int, depth: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def run(mode: str, args: argparse.Namespace, directory: Path) -> tuple[list[float], list[float]]:
    model, optimizer = build(args.width, args.depth)
    data = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    step_times: list[float] = []
    call_times: list[float] = []
    checkpointer = AsyncCheckpointer(directory, every_steps=args.every, keep=2) if mode == "async" else None

    def state() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    for step in range(args.steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        model(data).square().mean().backward()
        optimizer.step()
        if step % args.every == 0:
            call = time.perf_counter()
            if mode == "sync":
                write_checkpoint(directory, step, state())
            elif checkpointer is not None:
                checkpointer.maybe_save(step, state)
            call_times.append(time.perf_counter() - call)
        step_times.append(time.perf_counter() - started)
    if checkpointer is not None:
        checkpointer.close()
    return step_times, call_times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024, help="MLP width (default: %(default)s)")
    parser.add_argument("--depth", type=int, default=8, help="MLP layers (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default: %(default)s)")
    parser.add_argument(
        "--steps", type=int, default=20, help="steps per mode and round (default: %(default)s)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of the three modes (default: %(default)s)"
    )
    parser.add_argument(
        "--every", type=int, default=5, help="checkpoint every N steps (default: %(default)s)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch compute threads, leaving a core to the writer (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON report: each mode's mean step, "
                        "its ratio to no checkpoints and its median checkpoint call")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = sum(p.numel() for p in build(args.width, args.depth)[0].parameters())
    say = (lambda line: None) if args.json else print
    say(
        f"model: {params / 1e6:.1f} M parameters, checkpoint ~{params * 12 / 2**20:.0f} MiB (weights + Adam), "
        f"{args.rounds} x {args.steps} steps, every {args.every}, torch threads {torch.get_num_threads()}"
    )
    results: dict[str, tuple[list[float], list[float]]] = {mode: ([], []) for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        run("none", argparse.Namespace(**{**vars(args), "steps": 5}), Path(tmp) / "warmup")
        # Interleave the modes over rounds, so load from other processes hits them alike.
        for round_index in range(args.rounds):
            for mode in MODES:
                steps, calls = run(mode, args, Path(tmp) / f"{mode}-{round_index}")
                results[mode][0].extend(steps)
                results[mode][1].extend(calls)
    base = statistics.mean(results["none"][0])
    say(f"{'mode':<6} {'mean step ms':>12} {'ratio':>6} {'median call ms':>15}")
    rows = []
    for mode, (steps, calls) in results.items():
        mean = statistics.mean(steps)
        call = f"{statistics.median(calls) * 1e3:15.1f}" if calls else f"{'-':>15}"
        say(f"{mode:<6} {mean * 1e3:12.1f} {mean / base:6.2f} {call}")
        rows.append({"mode": mode, "mean_step_ms": round(mean * 1e3, 2), "ratio_to_none": round(mean / base, 3),
                     "median_call_ms": round(statistics.median(calls) * 1e3, 2) if calls else None})
    if args.json:
        print(json.dumps({"parameters_m": round(params / 1e6, 2), "checkpoint_mib": round(params * 12 / 2**20),
                          "steps": args.steps, "rounds": args.rounds, "every": args.every,
                          "threads": torch.get_num_threads(), "modes": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
