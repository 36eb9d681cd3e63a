"""Following the log (``Store.follow``): what the sidecar's tier feed reads to find the segment
records (F_SEGMENT) any process appended, exactly once each, lock-free."""

from __future__ import annotations

import mmap
import random
import uuid
from collections.abc import Callable

import pytest

from tests.tokcache.store.store_helpers import ids_of, key
from tokcache.store import F_SEGMENT, Kind, Store
from tokcache.store._layout import ID_WIDTHS, W_TAIL, geometry_for
from tokcache.store._segment import shm_path

Open = Callable[..., Store]


def _follow_all(store: Store, cursor: int, limit: int = 4096) -> tuple[int, list[tuple[bytes, bytes]], int]:
    """Follow from ``cursor`` until caught up: (cursor, entries, calls made)."""
    out: list[tuple[bytes, bytes]] = []
    calls = 0
    while True:
        calls += 1
        nxt, items = store.follow(cursor, limit=limit)
        out += items
        if nxt == cursor:
            return cursor, out, calls
        cursor = nxt


@pytest.mark.parametrize("id_bytes", ID_WIDTHS)
def test_follow_returns_each_segment_records_entries_once_in_order(open_store: Open) -> None:
    """Only records put with F_SEGMENT are returned, each key with the first n ids of its record
    as packed u32 (whatever the segment's width), in log order; a caught-up cursor returns
    nothing until more is written, then only that; ``limit`` bounds the records looked at per
    call, and a follower calling again catches up; bad flags are refused."""
    store = open_store()
    start = store.head()
    want: list[tuple[bytes, bytes]] = []
    for i in range(40):
        ids = ids_of("follow", i)
        n = len(ids) // 4
        entries = [(key("seg", i), n), (key("seg-half", i), n // 2)]
        flags = F_SEGMENT if i % 3 else 0
        assert store.put(None, 0, ids, entries, Kind.AR, flags=flags) is not None
        if flags:
            want += [(key("seg", i), ids), (key("seg-half", i), ids[:4 * (n // 2)])]
    cursor, got, calls = _follow_all(store, start)
    assert got == want and cursor == store.head() and calls == 2
    assert store.follow(cursor) == (cursor, [])
    assert store.put(None, 0, ids_of("late"), [(key("late"), 3)], Kind.AR, flags=F_SEGMENT) is not None
    assert store.follow(cursor) == (store.head(), [(key("late"), ids_of("late")[:12])])
    cursor, got, calls = _follow_all(store, start, limit=7)
    assert got == [*want, (key("late"), ids_of("late")[:12])] and calls >= 41 // 7
    with pytest.raises(ValueError):
        store.put(None, 0, ids_of("x"), [(key("x"), 1)], Kind.AR, flags=1)


def test_a_cursor_that_fell_behind_tail_resumes_at_tail(open_store: Open) -> None:
    """A follower that fell behind (the log wrapped past its cursor: the records it had not
    read were evicted) starts again at tail: it gets every segment record still in the log,
    none of the evicted ones, and no garbage from the bytes that overwrote them."""
    store = open_store(size=64 << 10, fingerprint=uuid.uuid4().hex)
    behind = store.head()
    written: list[tuple[int, bytes, bytes]] = []  # (LSN, key, packed ids)
    for i in range(400):
        ids = ids_of("wrap", i)
        ref = store.put(None, 0, ids, [(key("wrap", i), len(ids) // 4)], Kind.AR, flags=F_SEGMENT)
        assert ref is not None
        written.append((ref.lsn, key("wrap", i), ids))
    tail = int(store._words[W_TAIL])
    assert tail > behind  # the follower's cursor is evicted
    cursor, got, _ = _follow_all(store, behind)
    assert cursor == store.head()
    assert got == [(k, ids) for lsn, k, ids in written if lsn >= tail]
    assert 0 < len(got) < len(written)


def test_a_damaged_record_is_skipped_and_following_goes_on(open_store: Open) -> None:
    """A record whose bytes no longer verify (a stray write) is skipped: the follower never
    hands out ids its check does not cover, and the records after it still come."""
    store = open_store(fingerprint=uuid.uuid4().hex)
    start = store.head()
    refs = []
    for i in range(6):
        ref = store.put(None, 0, ids_of("dmg", i, n=20), [(key("dmg", i), 20)], Kind.AR, flags=F_SEGMENT)
        assert ref is not None
        refs.append(ref)
    arena = geometry_for(store.size).arena_off
    rng = random.Random(3)
    with open(shm_path(store.name), "r+b") as f, mmap.mmap(f.fileno(), 0) as raw:
        at = arena + refs[2].lsn % store._log.size + 120 + rng.randrange(40)  # in its ids
        raw[at] ^= 0x40
    cursor, got, _ = _follow_all(store, start)
    assert cursor == store.head()
    assert [k for k, _ in got] == [key("dmg", i) for i in (0, 1, 3, 4, 5)]
    assert all(ids == ids_of("dmg", int(i), n=20) for (k, ids), i in zip(got, (0, 1, 3, 4, 5), strict=True))
