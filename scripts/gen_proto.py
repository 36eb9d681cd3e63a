"""Regenerate the committed gRPC/protobuf code from proto/ (the only source).

Usage: python scripts/gen_proto.py [--out DIR]

Writes ``tokcache/v1/*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under
``client/`` (or DIR), so generated imports are package-absolute
(``from tokcache.v1 import tokenizer_pb2``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
DEFAULT_OUT = ROOT / "client"


def generate(out: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) over every .proto; return the files written."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency, imported lazily

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = sorted(out.joinpath("tokcache").rglob("*_pb2*.py*"))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ns = parser.parse_args()
    for path in generate(ns.out):
        print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
