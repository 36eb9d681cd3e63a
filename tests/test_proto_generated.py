"""The committed generated code is what proto/ generates, up to the generators' version stamps."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent

# What protoc and its gRPC plugin stamp with their own version, not the proto's content: the
# grpcio the stubs ask for at import, the protobuf runtime the messages check, and a comment.
# A new grpcio-tools on PyPI changes them (1.85.1 -> 1.85.4 did), and a clean install gets
# the newest: compared byte for byte, every CI run after such a release
# failed until someone regenerated. The committed stamps are the floors pyproject.toml states.
_STAMPS = [
    re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.M),
    re.compile(r"^# Protobuf Python Version: \S+$", re.M),
    re.compile(r"^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:.*\n)*?\)$", re.M),
]


def _content(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    for stamp in _STAMPS:
        text = stamp.sub("<generator version>", text)
    return text


def _floor(name: str) -> Version:
    """The ``>=`` bound of pyproject.toml's dependency on ``name``."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    for dependency in pyproject["project"]["dependencies"]:
        requirement = Requirement(dependency)
        if requirement.name == name:
            floors = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
            assert len(floors) == 1, f"pyproject.toml: {dependency!r} states no single floor"
            return floors[0]
    raise AssertionError(f"pyproject.toml does not depend on {name}")


def test_regenerating_changes_nothing(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = gen
    spec.loader.exec_module(gen)
    written = gen.generate(tmp_path)
    assert written, "protoc wrote nothing"
    committed = ROOT / "client"
    for path in written:
        rel = path.relative_to(tmp_path)
        assert (committed / rel).is_file(), f"{rel} is generated but not committed"
        assert _content(path) == _content(committed / rel), f"{rel} differs: run `make proto`"
    generated = {p.relative_to(committed) for p in committed.joinpath("tokcache").rglob("*_pb2*.py*")}
    assert generated == {p.relative_to(tmp_path) for p in written}, "stale generated files"


def test_the_stamps_are_what_the_dependencies_promise() -> None:
    """The committed stubs refuse to import under an older grpcio, and the messages under an
    older protobuf, than their stamps: the dependency floors say at least as much, so an install
    that satisfies pyproject.toml imports them."""
    grpc_py = (ROOT / "client" / "tokcache" / "v1" / "tokenizer_pb2_grpc.py").read_text(encoding="utf-8")
    m = _STAMPS[0].search(grpc_py)
    assert m
    assert _floor("grpcio") >= Version(m.group(1))
    pb2 = (ROOT / "client" / "tokcache" / "v1" / "tokenizer_pb2.py").read_text(encoding="utf-8")
    m = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", pb2)
    assert m
    assert _floor("protobuf") >= Version(".".join(m.groups()))
    # The stamps themselves are still found (else the comparison above ignores nothing).
    for stamp, text in ((_STAMPS[0], grpc_py), (_STAMPS[1], pb2), (_STAMPS[2], pb2)):
        assert stamp.search(text), stamp.pattern
