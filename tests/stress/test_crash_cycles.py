"""SIGKILL a real sidecar at random moments under concurrent load, restart it, repeat.

Default 12 cycles (~45 s); ``TOKCACHE_CRASH_CYCLES=200`` for the full run (see
bench/crash_cycles.py for the JSON report).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from tests.stress.crash import run_crash_cycles
from tests.stress.harness import Workload, unlink_prefix

CYCLES = int(os.environ.get("TOKCACHE_CRASH_CYCLES", "12"))


def test_kill_restart_cycles(tmp_path: Path) -> None:
    prefix = f"tkcrash-{uuid.uuid4().hex[:8]}"
    try:
        report = run_crash_cycles(tmp_path, prefix, cycles=CYCLES, threads=4, shm_size="1MiB",
                                  workload=Workload(conversations=50, turns=6, words=(30, 150)).build())
    finally:
        unlink_prefix(prefix)
    assert report.wrong_answers == 0, report.wrong_examples
    assert report.requests_ok > 100 * (CYCLES - report.kills_before_ready)
    # Every life after the first served warm hits from the surviving segment.
    assert report.cycles_warm_checked >= CYCLES - report.kills_before_ready
    assert report.cycles_with_warm_hit == report.cycles_warm_checked
    # Nothing leaks: the segment and its semaphore, nothing else, same sizes every cycle.
    assert report.shm_max_objects == 2
    assert report.shm_after_first["size"] == report.shm_after_last["size"]
    assert report.segment_max_allocated <= report.shm_cap
    assert report.lock_recoveries == report.kills_holding_lock
