"""bench/prefix_reuse.py --quick end to end: a real sidecar, exit 0, the JSON and PNG it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "prefix_reuse.py"
Run = tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("prefix_reuse")
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(out)]
    pythonpath = os.pathsep.join([str(ROOT), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": pythonpath}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    data = json.loads((out / "prefix_reuse.json").read_text()) if (out / "prefix_reuse.json").exists() else {}
    return proc, data, out


def test_exit_zero_and_outputs(run: Run) -> None:
    proc, data, out = run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert data["ok"] is True
    png = out / "prefix_reuse.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tokcache/limit" in proc.stdout and "baseline/limit" in proc.stdout


def test_json_content(run: Run) -> None:
    _, data, _ = run
    cfg = data["config"]
    assert cfg["conversations"] == 1 and cfg["turns"] == 5 and cfg["quick"] is True
    assert cfg["rates"] == [0.0, 0.001, 0.01, 0.05] and cfg["block_sizes"] == [16, 128]
    rows = data["rows"]
    assert [(r["rate"], r["block_size"]) for r in rows] == [(r, b) for r in cfg["rates"] for b in (16, 128)]
    for r in rows:
        assert 0 <= r["baseline"] <= r["limit"]
        assert r["limit"] > 0
        assert r["rate_label"].endswith("%")
    assert data["limit_violations"] == [] and data["mismatches"] == []
    # rate 0: generated ids are canonical, so even the baseline reaches the limit
    for r in rows[:2]:
        assert r["baseline"] == r["limit"]
    emu = data["emulator"]
    assert emu["0%"]["achieved"] == 0.0 and emu["5%"]["achieved"] > 0.01
    for blocks in data["per_turn"].values():
        for paths in blocks.values():
            for series in paths.values():
                assert len(series["share"]) == 5
                assert series["reused"][0][0] == 0  # turn 1 meets an empty cache


def test_tokcache_reaches_the_limit(run: Run) -> None:
    _, data, _ = run
    tc = data["tokcache"]
    assert tc["available"], tc["reason"]
    assert tc["refusals"] == []
    for r in data["rows"]:
        assert r["tokcache"] is not None and r["tokcache_share"] >= 0.999, r
    # every turn after the first is served from recorded output ids
    for rate_key, sources in tc["decision_sources"].items():
        assert sources.get("ar", 0) == data["config"]["turns"] - 1, (rate_key, sources)
    assert tc["turns_equal_to_oracle"] == tc["turns"]
