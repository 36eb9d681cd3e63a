"""Several processes: readers, concurrent writers, a dead lock holder, writers killed mid-put."""

from __future__ import annotations

import multiprocessing
import random
import time
from collections.abc import Callable

import posix_ipc
import pytest

from tests.tokcache.store import store_helpers as helpers
from tests.tokcache.store.store_helpers import conversations, expected, ids_of, key, put_turn
from tokcache.store import Kind, LockTimeout, Store, _lock
from tokcache.store._layout import ID_WIDTHS

Open = Callable[..., Store]
SPAWN = multiprocessing.get_context("spawn")
SIZE = 1 << 20
both_widths = pytest.mark.parametrize("id_bytes", ID_WIDTHS)


@both_widths
def test_child_reads_what_parent_wrote(open_store: Open, shm_prefix: str) -> None:
    store = open_store(size=SIZE)
    want: dict[bytes, bytes] = {}
    for c, t in conversations(5, 6):
        put_turn(store, c, t)
        want.update(expected(c, t))
    keys = [*want, key("absent")]
    with SPAWN.Pool(1) as pool:
        got = pool.apply(helpers.child_read, (shm_prefix, SIZE, keys))
    assert got == [*want.values(), None]


def test_two_writers_interleave(open_store: Open, shm_prefix: str) -> None:
    store = open_store(size=4 << 20)
    n_conv, turns, shared = 8, 10, 7
    procs = [
        SPAWN.Process(target=helpers.child_write, args=(shm_prefix, 4 << 20, w, n_conv, turns, shared)) for w in (1, 2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for w in (1, 2):
        for c, t in conversations(n_conv, turns):
            for k, ids in expected(w * 1000 + c, t).items():
                assert store.get(k) == ids
    for j in range(shared):
        assert store.get(key("shared", j)) in (ids_of("shared", 1, j)[:20], ids_of("shared", 2, j)[:20])
    stats = store.stats()
    assert stats.puts == 2 * n_conv * turns * 2
    assert stats.lock_recoveries == 0


@both_widths
def test_reads_race_a_wrapping_writer(open_store: Open, shm_prefix: str) -> None:
    size = 64 << 10  # the writer laps the log every few hundred puts
    store = open_store(size=size)
    ready = SPAWN.Event()
    # 20 conversations do not fit: reads race the overwriting of the records they copy.
    writer = SPAWN.Process(target=helpers.child_put_cycle, args=(shm_prefix, size, 20, ready))
    writer.start()
    try:
        assert ready.wait(30)
        want = {k: v for c, t in conversations(20, 12) for k, v in expected(c, t).items()}
        keys = list(want)
        rng = random.Random(5)
        hits = reads = 0
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            k = rng.choice(keys)
            got = store.get(k)
            assert got is None or got == want[k]
            hits += got is not None
            reads += 1
    finally:
        writer.kill()
        writer.join()
    assert 100 < hits < reads, (hits, reads)
    assert store.stats().evictions > 0


@pytest.mark.parametrize("existing", [None, 2 << 20], ids=["absent", "other-size"])
def test_concurrent_opens_agree(open_store: Open, shm_prefix: str, existing: int | None) -> None:
    if existing is not None:
        open_store(size=existing).close()  # every child wants to replace this one
    n = 5
    barrier = SPAWN.Barrier(n)
    results: multiprocessing.Queue[tuple[bool, int]] = SPAWN.Queue()
    procs = [SPAWN.Process(target=helpers.child_open, args=(shm_prefix, SIZE, barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert len({inode for _, inode in got}) == 1  # all on one segment
    assert sorted(attached for attached, _ in got) == [False] + [True] * (n - 1)
    store = open_store(size=SIZE)
    assert store.attached_existing
    assert store.stats().puts == n


def _start_lock_holder(shm_prefix: str, size: int) -> multiprocessing.process.BaseProcess:
    ready = SPAWN.Event()
    holder = SPAWN.Process(target=helpers.child_hold_lock, args=(shm_prefix, size, ready))
    holder.start()
    assert ready.wait(30)
    return holder


def test_dead_lock_holder_is_recovered(open_store: Open, shm_prefix: str) -> None:
    store = open_store(size=SIZE, lock_timeout=0.3)
    holder = _start_lock_holder(shm_prefix, SIZE)
    with pytest.raises(LockTimeout):  # a live holder is waited for, then reported
        store.put(None, 0, ids_of("x"), [(key("x"), 1)], Kind.L0)
    holder.kill()  # SIGKILL, and not reaped yet: a zombie holds nothing either
    time.sleep(0.05)
    started = time.monotonic()
    assert store.put(None, 0, ids_of("x"), [(key("x"), 1)], Kind.L0)
    assert time.monotonic() - started < 1.0
    holder.join()
    assert store.get(key("x")) == ids_of("x")[:4]
    assert store.stats().lock_recoveries == 1
    # The recovered lock works normally afterwards.
    assert store.put(None, 0, ids_of("y"), [(key("y"), 1)], Kind.L0)
    assert store.stats().lock_recoveries == 1


def test_unknown_holder_is_recovered_after_grace(open_store: Open, monkeypatch: pytest.MonkeyPatch) -> None:
    # A holder that died between sem_wait and recording itself leaves no pid behind.
    monkeypatch.setattr(_lock, "STALE_GRACE", 0.3)
    store = open_store(size=SIZE, lock_timeout=0.1)
    sem = posix_ipc.Semaphore(f"{store.name}.lock")
    sem.acquire()
    sem.close()
    with pytest.raises(LockTimeout):
        store.put(None, 0, ids_of("x"), [(key("x"), 1)], Kind.L0)
    started = time.monotonic()
    while True:  # short waits add up across calls
        try:
            assert store.put(None, 0, ids_of("x"), [(key("x"), 1)], Kind.L0)
            break
        except LockTimeout:
            assert time.monotonic() - started < 2.0
    assert store.stats().lock_recoveries == 1
    assert store.get(key("x")) == ids_of("x")[:4]


def test_writers_killed_mid_put(open_store: Open, shm_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A writer killed between sem_wait and recording its pid (or between clearing it and
    # sem_post) leaves an unknown holder, recovered after STALE_GRACE: keep that short.
    monkeypatch.setattr(_lock, "STALE_GRACE", 0.5)
    size = 96 << 10  # small: the log wraps and evicts while the children write
    rng = random.Random(99)
    stuck = 0
    for round_ in range(8):
        ready = SPAWN.Event()
        child = SPAWN.Process(target=helpers.child_put_forever, args=(shm_prefix, size, round_ * 10_000, ready))
        child.start()
        assert ready.wait(30)
        time.sleep(rng.uniform(0.02, 0.25))
        child.kill()
        child.join()
        store = open_store(size=size)
        assert store.attached_existing
        sem = posix_ipc.Semaphore(f"{store.name}.lock")
        stuck += sem.value == 0  # it died holding the lock
        sem.close()
        hits = 0
        for c in range(round_ * 10_000, round_ * 10_000 + 400):
            for t in range(12):
                for k, ids in expected(c, t).items():
                    got = store.get(k)
                    assert got is None or got == ids
                    hits += got is not None
        assert hits > 0
        # The next writer gets the lock (recovering it if needed) and its puts land.
        for t in range(4):
            put_turn(store, 999_999 - round_, t)
        for k, ids in expected(999_999 - round_, 3).items():
            assert store.get(k) == ids
        store.close()
    assert open_store(size=size).stats().lock_recoveries == stuck
