"""The writer lock: a POSIX semaphore (initial value 1) that survives a holder's death.

A semaphore is not released by the kernel when its holder dies, so the holder records who
it is in the segment header (W_LOCK_PID / START / PIDNS) and bumps W_LOCK_EPOCH on every
acquisition. A waiter whose timed wait expires looks at that record:

* holder known dead (same pid namespace, and ``/proc`` says gone, zombie, or the pid now
  belongs to a process with another start time): take the lock over at once;
* holder unknown (pid 0: it died between ``sem_wait`` and writing its pid, or between
  clearing its pid and ``sem_post``; or it lives in another pid namespace): take over once
  the record (epoch included) has not changed for STALE_GRACE seconds while the semaphore
  stayed at 0. Critical sections last microseconds to milliseconds, so that long means dead;
* holder alive: keep waiting, and raise LockTimeout at the deadline.

Taking over does not post the semaphore: the dead holder's unit is handed to the recoverer,
which rewrites the holder record and later releases normally. Two waiters may both decide
the holder is dead; they serialise on an ``flock`` of the segment file (which the kernel
does release on death) and each re-checks, under it, that the holder record is unchanged
and the semaphore still at 0. The first one wins; the second sees the new epoch and goes
back to waiting. Posting instead would let both in (value 2), breaking mutual exclusion.
"""

from __future__ import annotations

import logging
import time
from typing import Final

import posix_ipc

from . import _proc
from ._layout import (
    W_LOCK_EPOCH,
    W_LOCK_PID,
    W_LOCK_PIDNS,
    W_LOCK_RECOVERIES,
    W_LOCK_START,
)
from ._segment import flocked
from .errors import LockTimeout

__all__ = ["DEFAULT_TIMEOUT", "POLL_INTERVAL", "STALE_GRACE", "WriterLock"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT: Final = 2.0
POLL_INTERVAL: Final = 0.02
STALE_GRACE: Final = 5.0
MODE: Final = 0o600

_HolderRecord = tuple[int, int, int, int]  # pid, start, pidns, epoch


class WriterLock:
    """Cross-process writer lock over the semaphore ``name``.

    ``words`` is the header viewed as u64 words; ``fd`` the segment file (for the recovery
    flock). Not reentrant. Threads of one process may share it: the semaphore blocks them
    like any other waiter, and a holder from this process is never considered dead.
    """

    def __init__(self, name: str, words: memoryview, fd: int, *, timeout: float) -> None:
        self.name = name
        self._sem = posix_ipc.Semaphore(name, posix_ipc.O_CREAT, mode=MODE, initial_value=1)
        self._words = words
        self._fd = fd
        self._timeout = timeout
        # What the holder record looked like and since when, kept across calls so that
        # short waits (put after put) add up to STALE_GRACE for an unknown holder.
        self._seen: _HolderRecord | None = None
        self._seen_since = 0.0

    def acquire(self, timeout: float | None = None) -> None:
        """Block until held; recover from a dead holder; LockTimeout after ``timeout`` s."""
        if self._try(0):
            return
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        while True:
            # Wait first, look at the holder only when a wait expires: a busy lock is nearly
            # always held by a live writer that is about to post (or is waiting for a core),
            # and the look reads /proc (~20 us of syscalls). With 16 writers on 2 cores about
            # half the acquisitions found the lock busy, and each paid that look first.
            remaining = deadline - time.monotonic()
            if remaining > 0 and self._try(min(POLL_INTERVAL, remaining)):
                return
            record = self._holder()
            now = time.monotonic()
            if record != self._seen:
                self._seen, self._seen_since = record, now
            if self._holder_gone(record, now - self._seen_since) and self._take_over(record):
                return
            if deadline <= now:
                raise LockTimeout(
                    f"writer lock {self.name} held by pid {record[0]} for over {now - self._seen_since:.1f} s"
                )

    def try_acquire(self) -> bool:
        """Take the lock if it is free right now (no waiting, no recovery)."""
        return self._try(0)

    def release(self) -> None:
        """Release a lock this process holds."""
        # Clear the record before posting: a record naming us after the post would let a
        # waiter that sees us exit "recover" a lock someone else holds by then. (START and
        # PIDNS mean nothing once PID is 0.) Dying between these two lines leaves an
        # unknown holder, recovered after STALE_GRACE.
        self._words[W_LOCK_PID] = 0
        self._sem.release()

    def close(self) -> None:
        """Drop this handle (the semaphore itself stays). Idempotent."""
        try:
            self._sem.close()
        except posix_ipc.ExistentialError:
            pass

    def unlink(self) -> None:
        """Remove the semaphore name. Idempotent.

        Processes still holding a handle keep the old semaphore while new openers create a
        new one, so unlink only when every user of the segment is going away.
        """
        try:
            posix_ipc.unlink_semaphore(self.name)
        except posix_ipc.ExistentialError:
            pass

    def _try(self, timeout: float) -> bool:
        me = _proc.current()  # before taking the lock: keep the unrecorded window short
        try:
            self._sem.acquire(timeout)
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return False
        self._mark_held(me)
        return True

    def _mark_held(self, me: _proc.Identity) -> None:
        # PID last: a waiter never sees our pid with the previous holder's start time.
        words = self._words
        words[W_LOCK_START] = me.start
        words[W_LOCK_PIDNS] = me.pidns
        words[W_LOCK_PID] = me.pid
        words[W_LOCK_EPOCH] = (words[W_LOCK_EPOCH] + 1) & 0xFFFF_FFFF_FFFF_FFFF

    def _holder(self) -> _HolderRecord:
        words = self._words
        return (words[W_LOCK_PID], words[W_LOCK_START], words[W_LOCK_PIDNS], words[W_LOCK_EPOCH])

    def _holder_gone(self, record: _HolderRecord, unchanged_for: float) -> bool:
        pid, start, pidns, _epoch = record
        me = _proc.current()
        if (pid, start, pidns) == (me.pid, me.start, me.pidns):
            return False  # another thread of this process: alive by definition
        state = _proc.liveness(_proc.Identity(pid, start, pidns))
        if state is _proc.Liveness.DEAD:
            return True
        return state is _proc.Liveness.UNKNOWN and unchanged_for >= STALE_GRACE

    def _take_over(self, record: _HolderRecord) -> bool:
        with flocked(self._fd):
            # Re-check under the flock: another waiter may have recovered (new epoch), or
            # the holder may have released after all (value 1: just acquire normally).
            if self._holder() != record or self._sem.value != 0:
                return False
            self._mark_held(_proc.current())
            self._words[W_LOCK_RECOVERIES] += 1
        log.warning("writer lock %s: took over from holder pid %d (dead or stuck)", self.name, record[0])
        return True
