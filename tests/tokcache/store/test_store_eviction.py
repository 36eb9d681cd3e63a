"""Capacity eviction (FIFO log + LRU copy-forward) and TTL expiry."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from tests.tokcache.store.store_helpers import (
    FakeClock,
    conversations,
    expected,
    full_ids,
    full_key,
    ids_of,
    key,
    put_turn,
)
from tokcache.store import Kind, Store
from tokcache.store._layout import ID_WIDTHS
from tokcache.store._segment import shm_path

Open = Callable[..., Store]
both_widths = pytest.mark.parametrize("id_bytes", ID_WIDTHS)


@both_widths
def test_fill_far_past_capacity(open_store: Open) -> None:
    store = open_store(size=128 << 10)
    arena = store.stats().arena_bytes
    written = 0
    puts: list[tuple[bytes, bytes]] = []
    i = 0
    while written < 40 * arena:
        ids = ids_of("fill", i, n=16 + i % 200)
        assert store.put(None, 0, ids, [(key("fill", i), len(ids) // 4)], Kind.L0)
        puts.append((key("fill", i), ids))
        written += len(ids)
        i += 1
        assert os.stat(shm_path(store.name)).st_size == 128 << 10
    stats = store.stats()
    assert stats.evictions > 0
    assert stats.used_bytes <= stats.arena_bytes
    hits = 0
    for k, ids in puts:
        got = store.get(k)
        assert got is None or got == ids
        hits += got is not None
    assert store.get(puts[0][0]) is None  # the oldest are gone
    assert store.get(puts[-1][0]) == puts[-1][1]  # the newest are there
    assert 0 < hits < len(puts) // 10


@both_widths
def test_chains_past_capacity_never_return_wrong_bytes(open_store: Open) -> None:
    store = open_store(size=96 << 10)
    want: dict[bytes, bytes] = {}
    for c, t in conversations(60, 12):
        put_turn(store, c, t)
        want.update(expected(c, t))
    hits = 0
    for k, ids in want.items():
        got = store.get(k)
        assert got is None or got == ids
        hits += got is not None
    assert hits > 0
    assert store.get(full_key(59, 11)) == full_ids(59, 11)


@both_widths
def test_touched_chain_survives_untouched_is_evicted(open_store: Open) -> None:
    store = open_store(size=256 << 10)
    for c, t in conversations(2, 10):  # conversation 0 will be read, 1 not
        put_turn(store, c, t)
    arena = store.stats().arena_bytes
    written = 0
    i = 0
    while written < 10 * arena:
        ids = ids_of("filler", i, n=250)
        assert store.put(None, 0, ids, [(key("filler", i), 250)], Kind.L1)
        written += len(ids)
        i += 1
        if i % 5 == 0:  # read far more often than every 1/8 arena of writes
            assert store.get(full_key(0, 9)) == full_ids(0, 9)
    assert store.get(full_key(0, 9)) == full_ids(0, 9)
    assert store.get(full_key(1, 9)) is None
    assert store.stats().consolidations >= 9


@both_widths
def test_put_inlines_a_parent_chain_it_would_evict(open_store: Open) -> None:
    store = open_store(size=64 << 10)
    arena = store.stats().arena_bytes
    parent_ids = ids_of("parent", n=100)
    assert store.put(None, 0, parent_ids, [(key("parent"), 100)], Kind.L1)
    i = 0
    while store.stats().used_bytes < arena - 2048:  # parent is now the oldest record
        assert store.put(None, 0, ids_of("f", i, n=100), [(key("f", i), 100)], Kind.L1)
        i += 1
    child_ids = ids_of("child", n=1024)  # 3-4 KiB stored: appending it evicts the parent
    assert store.put(key("parent"), 100, child_ids, [(key("child"), 1024), (key("half"), 1)], Kind.L1)
    assert store.get(key("parent")) is None
    assert store.get(key("child")) == parent_ids + child_ids
    assert store.get(key("half")) == parent_ids + child_ids[:4]


def test_ttl_per_kind(open_store: Open, clock: FakeClock) -> None:
    store = open_store(ttl={Kind.L0: 10.0, Kind.AR: 0.0}, clock=clock)
    assert store.put(None, 0, ids_of("l0"), [(key("l0"), 1)], Kind.L0)
    assert store.put(None, 0, ids_of("l1"), [(key("l1"), 1)], Kind.L1)
    assert store.put(None, 0, ids_of("ar"), [(key("ar"), 1)], Kind.AR)
    # A child of an L0 entry: the child's own TTL (none for L1) decides, the chain is data.
    assert store.put(key("l0"), 1, ids_of("child"), [(key("child"), 1)], Kind.L1)
    clock.now += 9.5
    assert store.get(key("l0")) == ids_of("l0")[:4]
    assert store.stats().live_entries[Kind.L0] == 1
    clock.now += 0.5
    assert store.get(key("l0")) is None
    assert store.get(key("l1")) == ids_of("l1")[:4]
    assert store.get(key("ar")) == ids_of("ar")[:4]
    assert store.get(key("child")) == ids_of("l0")[:4] + ids_of("child")[:4]
    stats = store.stats()
    assert stats.expired == 1
    assert stats.live_entries[Kind.L0] == 0
    assert stats.live_entries[Kind.L1] == 2


def test_expired_slots_are_reused(open_store: Open, clock: FakeClock) -> None:
    store = open_store(size=64 << 10, ttl={Kind.L0: 1.0}, clock=clock)
    slots = store.stats().index_slots
    for i in range(slots):
        assert store.put(None, 0, ids_of(i, n=1), [(key("old", i), 1)], Kind.L0)
    before = store.stats().index_evictions  # a full index displaces a few on the way
    clock.now += 2
    for i in range(slots // 2):
        assert store.put(None, 0, ids_of(i, n=1), [(key("new", i), 1)], Kind.L1)
    assert store.stats().index_evictions == before  # expired slots were taken first
    assert all(store.get(key("new", i)) == ids_of(i, n=1) for i in range(slots // 2))
