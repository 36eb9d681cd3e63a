"""Segment entries: keys that map to a slice of one record's own ids (a recorded output's
variants), the writes that share a lock (put_many), and following the log for them."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest

from tests.tokcache.store.store_helpers import key
from tokcache.store import F_SEGMENT, Kind, Store, StoreReader
from tokcache.store._layout import ID_WIDTHS

Open = Callable[..., Store]
both_widths = pytest.mark.parametrize("id_bytes", ID_WIDTHS)


def u32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


@both_widths
def test_a_start_maps_a_key_to_a_slice_of_its_record(open_store: Open) -> None:
    store = open_store()
    ids = u32(10, 11, 12, 13, 14, 15)
    ref = store.put(None, 0, ids, [(key("whole"), 6), (key("mid"), 5, Kind.AR, 2), (key("end"), 6, Kind.AR, 3)],
                    Kind.AR, flags=F_SEGMENT)
    assert ref is not None
    assert store.get(key("whole")) == ids
    assert store.get(key("mid")) == u32(12, 13, 14)
    assert store.get(key("end")) == u32(13, 14, 15)
    found = store.read(key("mid"))
    assert found is not None and found.rest == u32(12, 13, 14)
    reader = StoreReader.attach_name(store.name)
    try:  # the same answers through a read-only mapping (the walk a client runs)
        walked = reader.read(key("end"))
        assert walked is not None and walked.rest == u32(13, 14, 15)
        raw = reader.read(key("end"), widened=False)
        assert raw is not None and len(raw.rest) == 3 * store.id_bytes
    finally:
        reader.close()


def test_a_slice_is_no_prefix_and_needs_a_record_of_its_own(open_store: Open) -> None:
    store = open_store()
    assert store.put(None, 0, u32(1, 2, 3), [(key("s"), 3, Kind.AR, 1)], Kind.AR)
    # A record cannot continue a slice: its ids are not a chain's prefix.
    assert store.put(key("s"), 2, u32(4), [(key("child"), 1)], Kind.L1) is None
    assert store.put(None, 0, u32(1, 2, 3), [(key("p"), 3)], Kind.L1)
    for bad in ((key("x"), 2, Kind.AR, 2), (key("x"), 2, Kind.AR, 3), (key("x"), 3, Kind.AR, 1 << 24)):
        with pytest.raises(ValueError, match="start"):
            store.put(None, 0, u32(1, 2, 3), [bad], Kind.AR)
    with pytest.raises(ValueError, match="start"):  # only in a record without a parent
        store.put(key("p"), 3, u32(4, 5), [(key("x"), 2, Kind.AR, 1)], Kind.AR)


def test_put_many_stores_in_order_and_reports_each(open_store: Open) -> None:
    store = open_store()
    puts_before = store.stats().puts
    refs = store.put_many([
        (None, 0, u32(1, 2), [(key("a"), 2)], Kind.L1, 0),
        (key("a"), 2, u32(3), [(key("b"), 1)], Kind.L1, 0),  # continues the record put before it
        (key("gone"), 5, u32(9), [(key("c"), 1)], Kind.L1, 0),  # no such parent: refused, the rest go on
        (None, 0, u32(7, 8, 9), [(key("d"), 3, Kind.AR, 1)], Kind.AR, F_SEGMENT),
    ])
    assert [r is not None for r in refs] == [True, True, False, True]
    assert store.get(key("b")) == u32(1, 2, 3)
    assert store.get(key("d")) == u32(8, 9)
    assert store.stats().puts == puts_before + 3
    with pytest.raises(ValueError):  # a bad argument: nothing of the batch is stored
        store.put_many([(None, 0, u32(5), [(key("e"), 1)], Kind.L1, 0), (None, 0, u32(5), [], Kind.L1, 0)])
    assert store.get(key("e")) is None


def test_follow_returns_segment_entries_once_and_resumes_at_tail(open_store: Open) -> None:
    store = open_store(size=1 << 20)
    cursor = store.head()
    store.put(None, 0, u32(1, 2, 3), [(key("l1"), 3)], Kind.L1)
    store.put(None, 0, u32(4, 5, 6), [(key("seg"), 3, Kind.AR), (key("seg2"), 3, Kind.AR, 1)], Kind.AR,
              flags=F_SEGMENT)
    cursor, got = store.follow(cursor)
    assert sorted(got) == sorted([(key("seg"), u32(4, 5, 6)), (key("seg2"), u32(5, 6))])
    assert store.follow(cursor) == (cursor, [])  # each record once
    # Far behind: what was evicted meanwhile is skipped, the follower starts again at tail.
    big = u32(*range(20000))
    for i in range(80):
        store.put(None, 0, big, [(key("fill", i), 20000)], Kind.L1)
    store.put(None, 0, u32(7), [(key("late"), 1, Kind.AR)], Kind.AR, flags=F_SEGMENT)
    assert store.tail() > cursor
    cursor, got = store.follow(cursor)
    assert got == [(key("late"), u32(7))] and cursor == store.head()
