"""What the benchmarks compute alike: percentiles of latency samples, and a server's CPU time."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["percentile", "proc_cpu_s"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` (``q`` in [0, 100]), linearly interpolated between
    the two nearest ranks (numpy's default method); None when there are no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


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
