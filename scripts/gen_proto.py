"""Generate the protobuf and gRPC stubs for every `.proto` under `proto/`.

`proto/bamboo/<part>/v1/x.proto` is owned by the package `packages/bamboo-<part>`, and its stubs are
written to `packages/bamboo-<part>/src/bamboo/<part>/v1/`. With `--out-root DIR` everything is written
under DIR instead (same relative layout), which is how the stub-drift test compares against the committed
files.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def owner_src(proto: pathlib.Path) -> pathlib.Path:
    """The `src` directory of the package that owns `proto` (relative to the repository root)."""
    rel = proto.relative_to(PROTO_ROOT)
    if len(rel.parts) < 3 or rel.parts[0] != "bamboo":
        raise SystemExit(f"gen_proto: {proto} is not under proto/bamboo/<part>/")
    return pathlib.Path("packages") / f"bamboo-{rel.parts[1]}" / "src"


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    import grpc_tools
    from grpc_tools import protoc

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    written: list[pathlib.Path] = []
    for proto in proto_files():
        src = out_root / owner_src(proto)
        src.mkdir(parents=True, exist_ok=True)
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={src}",
            f"--pyi_out={src}",
            f"--grpc_python_out={src}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"gen_proto: protoc failed on {proto}")
        stem = proto.relative_to(PROTO_ROOT).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            written.append(src / f"{stem}{suffix}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-root", type=pathlib.Path, default=ROOT, help="write under this root instead")
    args = parser.parse_args(argv)
    for path in generate(args.out_root.resolve()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
