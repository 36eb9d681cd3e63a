"""The crash-cycle harness counts a writer lock left held by a killed holder once, however many
lives pass before someone recovers it (lives killed while loading never take the lock)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import uuid

from tests.stress.crash import _held_epoch
from tests.stress.harness import unlink_prefix
from tokcache.store import Kind, Store

FINGERPRINT = "ab" * 16


def _die_holding_lock(prefix: str) -> None:
    store = Store.open(prefix=prefix, fingerprint=FINGERPRINT, size=1 << 20)
    store._lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_lock_left_held_reads_as_one_holder_until_recovered() -> None:
    prefix = f"tkacct-{uuid.uuid4().hex[:8]}"
    try:
        store = Store.open(prefix=prefix, fingerprint=FINGERPRINT, size=1 << 20)
        assert _held_epoch(prefix) is None
        child = mp.get_context("spawn").Process(target=_die_holding_lock, args=(prefix,))
        child.start()
        child.join(60)
        assert child.exitcode == -signal.SIGKILL
        first = _held_epoch(prefix)
        assert first is not None
        assert _held_epoch(prefix) == first  # a life that never writes changes nothing: not a new holder
        # The next writer recovers the lock (a new epoch), writes and releases it.
        assert store.put(None, 0, (7).to_bytes(4, "little"), [(b"k" * 16, 1)], Kind.L1) is not None
        assert _held_epoch(prefix) is None
        assert store.stats().lock_recoveries == 1
        # Another holder killed: a new epoch, counted as another.
        child = mp.get_context("spawn").Process(target=_die_holding_lock, args=(prefix,))
        child.start()
        child.join(60)
        second = _held_epoch(prefix)
        assert second is not None and second != first
        store.close()
    finally:
        unlink_prefix(prefix)
