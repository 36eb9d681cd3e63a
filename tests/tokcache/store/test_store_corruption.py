"""Stray writes anywhere in a live segment: every get is None or exactly what was put."""

from __future__ import annotations

import mmap
import random
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tokcache.store.store_helpers import conversations, expected, ids_of, key, put_turn
from tokcache.store import Kind, Store
from tokcache.store._layout import HEADER_SIZE, ID_WIDTHS, geometry_for
from tokcache.store._segment import shm_path

Open = Callable[..., Store]
both_widths = pytest.mark.parametrize("id_bytes", ID_WIDTHS)


def _fill(store: Store, first_conv: int = 0, n_conv: int = 12, turns: int = 8) -> dict[bytes, bytes]:
    want: dict[bytes, bytes] = {}
    for c, t in conversations(n_conv, turns):
        put_turn(store, first_conv + c, t)
        want.update(expected(first_conv + c, t))
    for i in range(40):
        ids = ids_of("single", first_conv, i)
        assert store.put(None, 0, ids, [(key("single", first_conv, i), len(ids) // 4)], Kind.AR)
        want[key("single", first_conv, i)] = ids
    return want


def _check(store: Store, want: dict[bytes, bytes]) -> int:
    hits = 0
    for k, ids in want.items():
        got = store.get(k)
        assert got is None or got == ids, k.hex()
        hits += got is not None
    return hits


@contextmanager
def _raw(store: Store) -> Iterator[mmap.mmap]:
    """A second mapping of the segment: writes land in the live pages."""
    with open(shm_path(store.name), "r+b") as f, mmap.mmap(f.fileno(), 0) as raw:
        yield raw


def _region(store: Store, rng: random.Random) -> int:
    """A random offset, weighted towards the parts that matter (the live log first)."""
    geometry = geometry_for(store.size)
    index_end = geometry.arena_off
    r = rng.random()
    if r < 0.01:
        return rng.randrange(0, HEADER_SIZE)
    if r < 0.03:
        return rng.randrange(256, 512)  # head, tail, retired, lock words
    if r < 0.3:
        return rng.randrange(HEADER_SIZE, index_end)
    return geometry.arena_off + rng.randrange(max(1, store.stats().used_bytes))


@both_widths
def test_random_writes(open_store: Open) -> None:
    store = open_store(size=64 << 10)
    want = _fill(store)
    assert store.stats().used_bytes > store.stats().arena_bytes // 2
    rng = random.Random(20240601)
    total_hits = 0
    with _raw(store) as raw:
        for round_ in range(250):
            for _ in range(rng.randint(1, 3)):
                off = _region(store, rng)
                n = min(rng.choice([1, 1, 2, 4, 8, 16, 64, 512]), store.size - off)
                raw[off : off + n] = rng.randbytes(n) if rng.random() < 0.8 else bytes(n)
            total_hits += _check(store, want)
            if round_ % 25 == 0:  # writers keep working on a damaged segment
                fresh = _fill(store, first_conv=1000 + round_, n_conv=2, turns=4)
                assert _check(store, fresh) > 0
                want.update(fresh)
    assert total_hits > 10 * len(want)  # the checks were not vacuous
    store.close()
    reopened = open_store(size=64 << 10)  # attached (or replaced if the header was hit)
    _check(reopened, want)
    fresh = _fill(reopened, first_conv=5000, n_conv=2, turns=4)
    assert _check(reopened, fresh) == len(fresh)


@both_widths
def test_bit_flips_in_records_are_caught(open_store: Open) -> None:
    store = open_store()
    want = _fill(store)
    rng = random.Random(7)
    used = store.stats().used_bytes
    with _raw(store) as raw:
        for _ in range(300):
            off = geometry_for(store.size).arena_off + rng.randrange(used)
            raw[off] ^= 1 << rng.randrange(8)
            hits = _check(store, want)
    assert hits < len(want)
    assert store.stats().corrupt > 0


@both_widths
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    writes=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.binary(min_size=1, max_size=24)),
        min_size=1,
        max_size=12,
    )
)
def test_arbitrary_writes(open_store: Open, writes: list[tuple[float, bytes]]) -> None:
    store = open_store(size=64 << 10, fingerprint=uuid.uuid4().hex)
    try:
        want = _fill(store, n_conv=4, turns=5)
        with _raw(store) as raw:
            for where, data in writes:
                off = int(where * (store.size - len(data)))
                raw[off : off + len(data)] = data
        _check(store, want)
        fresh = _fill(store, first_conv=77, n_conv=1, turns=3)
        assert _check(store, fresh) > 0
        _check(store, want)
    finally:
        store.unlink()
        store.close()
