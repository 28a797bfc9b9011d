"""Rewrite the test modules' asserts once, before `make test`'s pytest workers collect them.

pytest rewrites the assert statements of every test module and conftest.py it imports, and caches the result in
``__pycache__`` only where Python writes bytecode. Where ``PYTHONDONTWRITEBYTECODE`` is set (as on this project's
machines), each of `make test`'s three workers rewrote all of them again: about half of the CPU a worker spends
collecting the suite (8.6 to 10.4 CPU-s uncached, 4.2 to 5.2 with this cache, in three interleaved runs). This
script writes pytest's cache for those files on every core, once, and the workers read it (pytest reads its cache
whether or not it may write it).

It is a speed-up only, and checks nothing: a file it cannot write is left to pytest, and pytest ignores a cached
file that does not match its own format and rewrites as before. Where pytest's internals have moved, the script
says so in one line and exits 0.

    python scripts/warm_assert_cache.py [ROOT]    (default: the repository root)
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

#: Where the test modules live, below the repository root (pyproject.toml's ``testpaths``).
TEST_ROOTS = ("packages", "tests")


def test_files(root: Path) -> list[Path]:
    """The files pytest rewrites when it collects the suite: every ``test_*.py`` (``python_files``) and every
    ``conftest.py`` below ``TEST_ROOTS``, and the root's own ``conftest.py``."""
    found = [root / "conftest.py"] if (root / "conftest.py").is_file() else []
    for top in TEST_ROOTS:
        for path in (root / top).rglob("*.py"):
            if path.name.startswith("test_") or path.name == "conftest.py":
                found.append(path)
    return sorted(found)


def warm(path: Path) -> bool:
    """Write pytest's rewritten code of ``path`` into its cache; False where it is cached already, does not parse,
    or cannot be written."""
    from _pytest.assertion import rewrite

    pyc = rewrite.get_cache_dir(path) / (path.name[:-3] + rewrite.PYC_TAIL)
    if rewrite._read_pyc(path, pyc) is not None or not rewrite.try_makedirs(pyc.parent):
        return False
    source = path.read_bytes()
    try:
        tree = ast.parse(source, filename=str(path))
    except (SyntaxError, ValueError):
        return False  # pytest reports it where it collects the file
    rewrite.rewrite_asserts(tree, source, str(path), None)  # no config: pytest's defaults, as this repo's ini has
    code = compile(tree, str(path), "exec", dont_inherit=True)
    partial = pyc.with_name(f"{pyc.name}.{os.getpid()}")
    try:
        with open(partial, "wb") as out:
            rewrite._write_pyc_fp(out, importlib.util.source_hash(source), code)
        os.replace(partial, pyc)  # whole or not at all, as pytest writes it
    except OSError:
        partial.unlink(missing_ok=True)
        return False
    return True


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parents[1])
    try:
        from _pytest.assertion import rewrite

        for name in ("get_cache_dir", "PYC_TAIL", "_read_pyc", "try_makedirs", "rewrite_asserts", "_write_pyc_fp"):
            getattr(rewrite, name)
    except (ImportError, AttributeError) as error:
        print(f"warm_assert_cache: pytest's assertion rewriting has moved ({error}); pytest will rewrite as usual")
        return 0
    files = test_files(root)
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        written = sum(pool.map(warm, files, chunksize=8))
    if written:
        print(f"warm_assert_cache: rewrote the asserts of {written} of {len(files)} test files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
