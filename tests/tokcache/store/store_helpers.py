"""Deterministic test data and the bodies of child processes for the store tests.

Children are started with the ``spawn`` method, so everything they run lives here (an
importable module, not a test file). Data is a pure function of its coordinates, so a
parent can check what a killed child may have written without talking to it.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Iterator
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier, Event

from tokcache.store import Kind, Store, StoreReader
from tokcache.store._segment import shm_path

FINGERPRINT = "0123456789abcdef0123456789abcdef"


class FakeClock:
    """An injectable epoch clock: set ``now``."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def key(*parts: object) -> bytes:
    """A 16-byte key, as callers make them (a hash of something)."""
    return hashlib.sha256(repr(parts).encode()).digest()[:16]


def ids_of(*parts: object, n: int | None = None) -> bytes:
    """Pseudo-random packed uint32 ids, 1-60 of them unless ``n`` is given.

    Every id is < 2**24 (as in any real vocabulary), so 3-byte segments store them all;
    each byte below the top one is random, so a width bug cannot go unnoticed.
    """
    rng = random.Random(repr(parts))
    count = rng.randint(1, 60) if n is None else n
    ids = bytearray(rng.randbytes(4 * count))
    ids[3::4] = bytes(count)
    return bytes(ids)


# --- conversations: turn t of conversation c continues turns 0..t-1 ----------------------


def turn_ids(c: int, t: int) -> bytes:
    return ids_of("turn", c, t)


def full_key(c: int, t: int) -> bytes:
    return key("full", c, t)


def mid_key(c: int, t: int) -> bytes:
    return key("mid", c, t)


def full_ids(c: int, t: int) -> bytes:
    """What full_key(c, t) maps to: every turn up to and including t."""
    return b"".join(turn_ids(c, i) for i in range(t + 1))


def mid_ids(c: int, t: int) -> bytes:
    """What mid_key(c, t) maps to: turns before t and the first half of turn t."""
    ids = turn_ids(c, t)
    return full_ids(c, t - 1) + ids[: len(ids) // 8 * 4] if t else ids[: len(ids) // 8 * 4]


def expected(c: int, t: int) -> dict[bytes, bytes]:
    return {full_key(c, t): full_ids(c, t), mid_key(c, t): mid_ids(c, t)}


def put_turn(store: Store, c: int, t: int) -> None:
    """Put turn t of conversation c, chained on turn t-1 (inline if that one is gone)."""
    ids = turn_ids(c, t)
    n = len(ids) // 4
    entries = [(full_key(c, t), n), (mid_key(c, t), n // 2)]
    if t and store.put(full_key(c, t - 1), len(full_ids(c, t - 1)) // 4, ids, entries, Kind.L1):
        return
    prefix = full_ids(c, t - 1) if t else b""
    base = len(prefix) // 4
    assert store.put(None, 0, prefix + ids, [(k, base + m) for k, m in entries], Kind.L1)


def conversations(n_conv: int, turns: int) -> Iterator[tuple[int, int]]:
    for c in range(n_conv):
        for t in range(turns):
            yield c, t


# --- child process bodies --------------------------------------------------------------


def child_read(prefix: str, size: int, keys: list[bytes]) -> list[bytes | None]:
    """Open the segment and read ``keys`` (run in a pool of one)."""
    with Store.open(prefix=prefix, fingerprint=FINGERPRINT, size=size) as store:
        return [store.get(k) for k in keys]


def child_read_only(prefix: str, keys: list[bytes]) -> list[bytes | None]:
    """Map the segment read-only and read ``keys`` (run in a pool of one)."""
    with StoreReader.attach(prefix=prefix, fingerprint=FINGERPRINT) as reader:
        return [reader.get(k) for k in keys]


def child_write(prefix: str, size: int, writer: int, n_conv: int, turns: int, shared: int) -> None:
    """Write this writer's own conversations, interleaved with puts of shared keys."""
    with Store.open(prefix=prefix, fingerprint=FINGERPRINT, size=size) as store:
        for i, (c, t) in enumerate(conversations(n_conv, turns)):
            put_turn(store, writer * 1000 + c, t)
            j = i % shared
            assert store.put(None, 0, ids_of("shared", writer, j), [(key("shared", j), 5)], Kind.L0)


def child_hold_lock(prefix: str, size: int, ready: Event) -> None:
    """Take the writer lock and keep it until killed."""
    store = Store.open(prefix=prefix, fingerprint=FINGERPRINT, size=size)
    store._lock.acquire()
    ready.set()
    time.sleep(120)


def child_put_forever(prefix: str, size: int, first_conv: int, ready: Event) -> None:
    """Put conversation after conversation until killed."""
    store = Store.open(prefix=prefix, fingerprint=FINGERPRINT, size=size)
    ready.set()
    c = first_conv
    while True:
        for t in range(12):
            put_turn(store, c, t)
        c += 1


def child_put_cycle(prefix: str, size: int, n_conv: int, ready: Event) -> None:
    """Re-put the same conversations over and over (the log wraps) until killed."""
    store = Store.open(prefix=prefix, fingerprint=FINGERPRINT, size=size)
    ready.set()
    while True:
        for c, t in conversations(n_conv, 12):
            put_turn(store, c, t)


def child_open(prefix: str, size: int, barrier: Barrier, results: Queue[tuple[bool, int]]) -> None:
    """Open the segment at the same moment as the other children; report what we got."""
    barrier.wait()
    with Store.open(prefix=prefix, fingerprint=FINGERPRINT, size=size) as store:
        assert store.put(None, 0, ids_of("open", os.getpid()), [(key("open", os.getpid()), 1)], Kind.L0)
        results.put((store.attached_existing, os.stat(shm_path(store.name)).st_ino))
