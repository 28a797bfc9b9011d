"""Build DeepSpeed's one CPU op that the tests need, ahead of them: ``make test`` runs this in the background,
at the lowest priority, while its first tests run.

``deepspeed.init_distributed`` on the CPU accelerator JIT-compiles the shared-memory collectives
(``deepspeed_shm_comm``, about 30 s on 2 cores) into ``TORCH_EXTENSIONS_DIR`` the first time it runs on a
machine, whatever the backend. The checkpoint/restart baseline's workers and ``bench_rc.py``'s DeepSpeed variant
(``scripts/gpu-check.sh --dry-run``) call it; without this, the first of them builds it inside a test, and every
other process waits on torch's build lock. A build that is up to date only loads (a few seconds). The tests
still build the op themselves where this did not run (a plain ``pytest``).

Run: ``.venv/bin/python scripts/build_ops.py`` (with ``DS_ACCELERATOR=cpu`` and ``TORCH_EXTENSIONS_DIR`` set, as
the Makefile exports them).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))

OPS = ("ShareMemCommBuilder",)
"""The op builders of DeepSpeed's CPU accelerator that the test suite loads."""


def main() -> int:
    from deepspeed.accelerator import get_accelerator

    started = time.monotonic()
    for name in OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is None:
            print(f"build_ops: DeepSpeed's {get_accelerator().device_name()} accelerator has no {name}",
                  file=sys.stderr)
            return 1
        builder.load(verbose=False)
        print(f"build_ops: {builder.NAME} ready in {os.environ['TORCH_EXTENSIONS_DIR']} "
              f"({time.monotonic() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
