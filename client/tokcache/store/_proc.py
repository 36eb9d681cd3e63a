"""Process identity and liveness, as far as Linux ``/proc`` can tell.

A pid alone does not identify a process that may have died: pids are reused, and a pid
means nothing in another pid namespace (containers of a pod do not share one unless
``shareProcessNamespace`` is set). So an identity is (pid, start time in clock ticks since
boot, pid-namespace inode), and :func:`liveness` answers UNKNOWN rather than guess when the
identity comes from another namespace.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

__all__ = ["Identity", "Liveness", "current", "liveness"]


class Liveness(enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Identity:
    """Who a process is: pid, start time (ticks since boot), pid namespace inode (0: unknown)."""

    pid: int
    start: int
    pidns: int


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _stat(pid: int | str) -> tuple[str, int] | None:
    """(state letter, start time) from /proc/<pid>/stat, None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])


_current: Identity | None = None


def current() -> Identity:
    """This process's identity (recomputed after a fork)."""
    global _current
    pid = os.getpid()
    if _current is None or _current.pid != pid:
        try:
            stat = _stat("self")
        except (OSError, ValueError, IndexError):
            stat = None
        _current = Identity(pid, stat[1] if stat else 0, _pidns())
    return _current


def liveness(who: Identity) -> Liveness:
    """Whether the process ``who`` still runs. Zombies count as dead (they hold nothing)."""
    me = current()
    if who.pid <= 0 or who.pidns == 0 or who.pidns != me.pidns:
        return Liveness.UNKNOWN
    try:
        stat = _stat(who.pid)
    except (OSError, ValueError, IndexError):
        return Liveness.UNKNOWN
    if stat is None:
        return Liveness.DEAD
    state, start = stat
    if state in ("Z", "X", "x") or (who.start and start != who.start):
        return Liveness.DEAD  # exited, or the pid now belongs to someone else
    return Liveness.ALIVE
