"""The committed generated code is exactly what proto/ generates."""

from __future__ import annotations

import filecmp
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
        assert filecmp.cmp(path, committed / rel, shallow=False), f"{rel} differs: run `make proto`"
    generated = {p.relative_to(committed) for p in committed.joinpath("tokcache").rglob("*_pb2*.py*")}
    assert generated == {p.relative_to(tmp_path) for p in written}, "stale generated files"
