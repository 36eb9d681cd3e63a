"""The index probes and slot writes in C (``_speedups.c``) give the answers of the Python loops in
``_index.py``, which are the reference: the same slot for every key, the same last live key of a
window, and byte-identical index regions (and eviction counts) after the same writes."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tokcache.native import pure_python
from tokcache.store._index import Index
from tokcache.store._layout import BUCKET_SIZE, HEADER_SIZE, LSN_BITS, W_INDEX_EVICTIONS

# (Index(native=True) is the Python loops where TOKCACHE_PURE_PYTHON=1 turns the C off: nothing to compare.)
pytestmark = pytest.mark.skipif(pure_python(), reason="TOKCACHE_PURE_PYTHON=1: no native index")

N_BUCKETS = 3  # few buckets: keys collide, buckets fill, free/dead/LRU victims all happen
OFF = 64  # the index starts past a small header, as in a segment


def _pair() -> tuple[Index, Index, bytearray, bytearray, memoryview, memoryview]:
    mem_py = bytearray(OFF + N_BUCKETS * BUCKET_SIZE)
    mem_c = bytearray(len(mem_py))
    words_py = memoryview(bytearray(HEADER_SIZE)).cast("Q")
    words_c = memoryview(bytearray(HEADER_SIZE)).cast("Q")
    return (Index(mem_py, OFF, N_BUCKETS, words_py, native=False),  # type: ignore[arg-type]
            Index(mem_c, OFF, N_BUCKETS, words_c, native=True),  # type: ignore[arg-type]
            mem_py, mem_c, words_py, words_c)


_key = st.binary(min_size=16, max_size=16).filter(lambda k: k != bytes(16))
# (key index, lsn, kind, expiry, access) writes over a small key pool, and tail/head/now.
_write = st.tuples(st.integers(0, 59), st.integers(0, 5000), st.integers(0, 3), st.sampled_from([0, 0, 50, 150]),
                   st.integers(0, 100))


@settings(max_examples=200, deadline=None)
@given(st.lists(_key, min_size=60, max_size=60, unique=True), st.lists(_write, max_size=160),
       st.sampled_from([0, 1500, 3000]), st.integers(5000, 6000), st.sampled_from([0.0, 100.0]))
def test_native_index_matches_the_python_loops(pool: list[bytes], writes: list[tuple[int, int, int, int, int]],
                                               tail: int, head: int, now: float) -> None:
    py, c, mem_py, mem_c, words_py, words_c = _pair()
    for k, lsn, kind, expiry, access in writes:
        lsn_kind = kind << LSN_BITS | lsn
        py.set(pool[k], lsn_kind, expiry, access, tail, head, now)
        c.set(pool[k], lsn_kind, expiry, access, tail, head, now)
        assert mem_c == mem_py
    assert words_c[W_INDEX_EVICTIONS] == words_py[W_INDEX_EVICTIONS]
    event(f"LRU evictions: {min(words_py[W_INDEX_EVICTIONS], 3)}")
    for key in pool:
        assert c.find(key) == py.find(key)
    for lo, hi in ((0, 60), (10, 30), (59, 60), (30, 10)):
        assert c.last_live(pool, lo, hi, now, tail) == py.last_live(pool, lo, hi, now, tail)


def test_native_index_refuses_a_buffer_too_small_and_a_bad_key() -> None:
    mem = bytearray(OFF + BUCKET_SIZE)
    index = Index(mem, OFF, N_BUCKETS, memoryview(bytearray(HEADER_SIZE)).cast("Q"), native=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not fit"):
        index.find(bytes(range(1, 17)))
    ok = Index(bytearray(OFF + N_BUCKETS * BUCKET_SIZE), OFF, N_BUCKETS,  # type: ignore[arg-type]
               memoryview(bytearray(HEADER_SIZE)).cast("Q"), native=True)
    with pytest.raises(TypeError, match="16-byte"):
        ok.find(b"short")
    with pytest.raises(TypeError, match="16-byte"):
        ok.last_live([b"short"], 0, 1, 0.0, 0)


def test_native_index_evicts_the_same_slot_when_every_slot_is_live() -> None:
    """Full buckets of live slots: both pick the least recently read (then oldest) slot."""
    py, c, mem_py, mem_c, words_py, words_c = _pair()
    keys = [bytes([i % 251 + 1]) * 8 + (i * 7919).to_bytes(8, "little") for i in range(200)]
    for i, key in enumerate(keys):
        for index in (py, c):
            index.set(key, 1 << LSN_BITS | (1000 + i), 0, (i * 37) % 50, 0, 10_000, 0.0)
        assert mem_c == mem_py, i
    assert words_py[W_INDEX_EVICTIONS] > 100 and words_c[W_INDEX_EVICTIONS] == words_py[W_INDEX_EVICTIONS]
    assert [c.find(k) for k in keys] == [py.find(k) for k in keys]


@settings(max_examples=100, deadline=None)
@given(st.lists(_key, min_size=60, max_size=60, unique=True),
       st.lists(st.lists(st.tuples(st.integers(0, 59), st.integers(0, 3), st.sampled_from([0, 50, 150])), max_size=12),
                max_size=20),
       st.sampled_from([0, 1500]), st.sampled_from([0.0, 100.0]))
def test_native_set_all_matches_the_python_loop(pool: list[bytes], records: list[list[tuple[int, int, int]]],
                                                tail: int, now: float) -> None:
    """A record's keys set in one C call (Store._append) land as Index.set puts them one by one."""
    py, c, mem_py, mem_c, words_py, words_c = _pair()
    for r, entries in enumerate(records):
        lsn = 2000 + 100 * r
        items = [(pool[k], 7, kind, expiry, 0) for k, kind, expiry in entries]
        py.set_all(items, lsn, r % 5, tail, 5000, now)
        c.set_all(items, lsn, r % 5, tail, 5000, now)
        assert mem_c == mem_py
    assert words_c[W_INDEX_EVICTIONS] == words_py[W_INDEX_EVICTIONS]


def test_native_set_all_refuses_bad_entries() -> None:
    _py, c, _mem_py, mem_c, _words_py, _words_c = _pair()
    good = (bytes(range(1, 17)), 0, 1, 0, 0)
    with pytest.raises(TypeError, match="16-byte"):
        c.set_all([good, (b"short", 0, 1, 0, 0)], 10, 0, 0, 100, 0.0)
    with pytest.raises(TypeError, match="tuples"):
        c.set_all([(bytes(range(1, 17)), 0)], 10, 0, 0, 100, 0.0)  # type: ignore[list-item]
    with pytest.raises(OverflowError):
        c.set_all([(bytes(range(1, 17)), 0, 256, 0, 0)], 10, 0, 0, 100, 0.0)
