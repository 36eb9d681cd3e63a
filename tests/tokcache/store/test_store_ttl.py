"""TTL per entry kind: never served once expired, space reclaimed, live chains kept."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.tokcache.store.store_helpers import FakeClock, ids_of, key
from tokcache.store import Kind, Store

Open = Callable[..., Store]


def test_each_key_of_a_record_has_its_own_kind(open_store: Open, clock: FakeClock) -> None:
    # The engine stores a request's L1 cut keys and its L0 whole-text key in one record.
    store = open_store(ttl={Kind.L0: 5.0, Kind.L1: 50.0}, clock=clock)
    ids = ids_of("req", n=40)
    assert store.put(None, 0, ids, [(key("cut"), 20), (key("whole"), 40, Kind.L0)], Kind.L1)
    assert store.stats().live_entries[Kind.L0] == 1
    clock.now += 5
    assert store.get(key("whole")) is None  # L0 TTL
    assert store.get(key("cut")) == ids[:80]  # L1 TTL not yet
    assert store.stats().live_entries == {Kind.L0: 0, Kind.L1: 1, Kind.AR: 0}
    clock.now += 45
    assert store.get(key("cut")) is None
    assert store.stats().expired == 2


def test_expired_records_are_swept_off_the_tail(open_store: Open, clock: FakeClock) -> None:
    store = open_store(size=256 << 10, ttl={Kind.L0: 10.0}, clock=clock)
    for i in range(50):
        assert store.put(None, 0, ids_of("old", i, n=100), [(key("old", i), 100)], Kind.L0)
    used = store.stats().used_bytes
    assert store.stats().ttl_evictions == 0
    clock.now += 11
    # Nothing expired is served, even before the sweep.
    assert all(store.get(key("old", i)) is None for i in range(50))
    # The next put sweeps (at most SWEEP_STEPS records per call), the maintenance tick too.
    assert store.put(None, 0, ids_of("new", n=10), [(key("new"), 10)], Kind.L1)
    swept = store.stats().ttl_evictions
    assert swept > 0
    while store.sweep():
        pass
    stats = store.stats()
    assert stats.ttl_evictions == 50
    assert stats.evictions_by_cause == {"cap": 0, "ttl": 50, "pressure": 0}
    assert stats.used_bytes < used // 20  # only the new record is left
    assert store.get(key("new")) == ids_of("new", n=10)


def test_sweep_stops_at_a_record_that_does_not_expire(open_store: Open, clock: FakeClock) -> None:
    store = open_store(ttl={Kind.L0: 10.0}, clock=clock)
    assert store.put(None, 0, ids_of("a", n=8), [(key("a"), 8)], Kind.L0)
    assert store.put(None, 0, ids_of("b", n=8), [(key("b"), 8)], Kind.L1)  # never expires
    assert store.put(None, 0, ids_of("c", n=8), [(key("c"), 8)], Kind.L0)
    # A record with one key that never expires is not swept, whatever its other keys do.
    assert store.put(None, 0, ids_of("d", n=8), [(key("d0"), 8), (key("d1"), 4, Kind.L1)], Kind.L0)
    clock.now += 11
    assert store.sweep() == 1  # "a" only: FIFO stops at "b"
    assert store.get(key("b")) == ids_of("b", n=8)
    assert store.get(key("c")) is None  # expired: not served though its bytes remain
    assert store.get(key("d1")) == ids_of("d", n=8)[:16]


def test_live_chain_over_expiring_parent_is_copied_forward(open_store: Open, clock: FakeClock) -> None:
    store = open_store(ttl={Kind.AR: 100.0}, clock=clock)
    parent = ids_of("parent", n=30)
    child = ids_of("child", n=10)
    assert store.put(None, 0, parent, [(key("parent"), 30)], Kind.AR)
    assert store.put(key("parent"), 30, child, [(key("child"), 10)], Kind.L1)
    clock.now += 50
    assert store.get(key("child")) == parent + child
    assert store.stats().consolidations == 0
    clock.now += 40  # the parent expires within an eighth of the shortest TTL
    assert store.get(key("child")) == parent + child
    assert store.stats().consolidations == 1
    clock.now += 20
    while store.sweep():
        pass
    assert store.stats().ttl_evictions == 1  # the parent record is gone...
    assert store.get(key("parent")) is None
    assert store.get(key("child")) == parent + child  # ...its data lives on in the copy


def test_a_mark_lives_until_its_own_expiry_and_a_past_one_withdraws_it(open_store: Open, clock: FakeClock) -> None:
    from tokcache.store import StoreReader
    from tokcache.store.errors import StoreClosed

    store = open_store(ttl={Kind.L1: 0.0}, clock=clock)  # L1 entries never expire: the mark's own expiry rules
    reader = StoreReader.attach_name(store.name, clock=clock)
    try:
        assert not store.marks() and not reader.marks()
        a, b = key(1), key(2)
        assert store.mark(a, int(clock.now) + 10) and store.mark(b, int(clock.now) + 10)
        assert store.marks() and reader.marks()  # a header counter: every process sees it
        assert reader.last_present([a, b], 0, 2) == 1 and store.get(a) == b""  # a record of no ids
        assert store.mark(b, 1)  # withdrawn
        assert reader.last_present([a, b], 0, 2) == 0
        clock.now += 10
        assert reader.last_present([a, b], 0, 2) == -1 and not reader.probe(a)
        assert store.marks()  # once marked, readers keep looking
        # ... but none can be live once the latest expiry is a second behind (the native fast
        # path is open again: tokcache.engine.lookup.Lookup._extend)
        assert reader.marks_live(clock.now) and store.marks_live(clock.now)  # (expiry + 0 s)
        assert not reader.marks_live(clock.now + 1) and not store.marks_live(clock.now + 1)
        assert store.mark(a, int(clock.now) + 30)
        assert reader.marks_live(clock.now + 29) and not reader.marks_live(clock.now + 31)
        from tokcache.store._layout import W_MARKS
        store._words[W_MARKS] += 1  # a mark whose writer did not record its expiry (an older one)
        assert reader.marks_live(clock.now + 10_000) and store.marks_live(clock.now + 10_000)
        for bad in (0, -1, 1 << 32):
            with pytest.raises(ValueError, match="expiry"):
                store.mark(a, bad)
        with pytest.raises(ValueError):
            store.mark(bytes(16), 5)
    finally:
        reader.close()
    store.close()
    with pytest.raises(StoreClosed):
        store.mark(key(3), 5)
