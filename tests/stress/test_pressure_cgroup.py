"""A real memory cgroup limit: the cache shrinks and gives its pages back, then grows back.

Skipped where no memory cgroup can be created (the simulated-signal tests in
tests/sidecar/test_pressure.py cover the policy everywhere).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest

from tests.stress import cgroup
from tests.stress.harness import ROOT, unlink_prefix

pytestmark = pytest.mark.skipif(not cgroup.available(), reason="cannot create a memory cgroup here")
SIZE = 16 << 20


class Child:
    def __init__(self, cg: cgroup.MemoryCgroup, prefix: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.stress.pressure_child", str(cg.procs_file), prefix, str(SIZE)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.last: dict[str, Any] = {}

    def read_until(self, predicate: Any, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"child exited {self.proc.wait()}")
            self.last = json.loads(line)
            if predicate(self.last):
                return self.last
        raise AssertionError(f"timed out; last: {self.last}")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_limit_lowered_then_raised() -> None:
    cg = cgroup.MemoryCgroup.create()
    prefix = f"tkcg-{uuid.uuid4().hex[:8]}"
    child = Child(cg, prefix)
    try:
        child.read_until(lambda m: m.get("filled"), 60)
        full = child.read_until(lambda m: "resident" in m, 10)
        assert full["state"] == "normal" and full["resident"] > SIZE * 0.9
        usage_full = cg.usage
        working = usage_full - cg.stat("total_inactive_file" if cg.version == 1 else "inactive_file")
        cg.set_limit(int(working / 0.93))  # 93 % of the limit: pressure (threshold 90 %)
        shrunk = child.read_until(
            lambda m: m["state"] == "pressure" and m["used"] <= m["soft_cap"] and m["resident"] < SIZE / 2, 10)
        time.sleep(0.5)
        usage_shrunk = cg.usage
        assert shrunk["used"] <= shrunk["soft_cap"] <= SIZE // 4
        assert shrunk["pressure_evictions"] > 0
        # The pages went back to the kernel: the cgroup's charge fell by most of the arena.
        assert usage_full - usage_shrunk > SIZE // 2, (usage_full, usage_shrunk)
        # Writes go on under the lowered limit. The monitor may regrow into the headroom it
        # freed, but only while the cgroup stays under its low mark (80 %): no flapping back
        # into pressure, the soft cap stays below the full arena, the process lives. Lines
        # printed within a monitor tick of the shrink still carry the sample that caused it
        # (``cgroup_ratio`` 0.93: the child prints ``monitor.last``), so the ones checked are
        # those printed from when ``usage_shrunk`` was read on.
        since = shrunk["t"] + 0.5
        for _ in range(30):
            held = child.read_until(lambda m: m["t"] >= since, 5)
            assert held["state"] in ("pressure", "recovering"), held
            assert held["used"] <= held["soft_cap"] < SIZE * 0.9, held
            assert held["cgroup_ratio"] is None or held["cgroup_ratio"] < 0.9, held
        assert cg.usage < cg.limit * 0.9  # type: ignore[operator]
        cg.set_limit(None)  # pressure over
        grown = child.read_until(lambda m: m["state"] == "normal" and m["resident"] > SIZE * 0.9, 30)
        assert grown["soft_cap"] > SIZE * 0.8 and cg.usage > usage_shrunk + SIZE // 2
    finally:
        child.close()
        cg.remove()
        unlink_prefix(prefix)
