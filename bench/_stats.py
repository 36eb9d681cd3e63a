"""What the benchmarks compute alike: percentiles, and the CPU time of a server process."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__ = ["percentile", "proc_cpu_s"]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` (linear between ranks); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def proc_cpu_s(server: Any) -> float:  # noqa: ANN401 - any contender with a ``_proc`` Popen
    """CPU seconds (user + system) ``server``'s process has used so far; 0 without one.

    Read from the process's CPU-time clock (Linux: ``clock_getcpuclockid``'s id for a pid,
    nanoseconds); ``/proc/<pid>/stat`` counts whole clock ticks (10 ms), which rounds a short
    run's server CPU to 0."""
    proc = getattr(server, "_proc", None)
    if proc is None:
        return 0.0
    try:
        return time.clock_gettime(((~proc.pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:
        pass
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
