"""The id width of a segment: 3-byte ids for 24-bit vocabularies, u32 at the API either way."""

from __future__ import annotations

import logging
import os
import struct
import uuid
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.tokcache.store.store_helpers import FINGERPRINT, key
from tokcache.native import pure_python
from tokcache.store import DirectLookup, Kind, SegmentMismatch, Store, StoreReader, _layout, id_bytes_for, l0_key
from tokcache.store._layout import ID_WIDTHS, U32_MAX, narrow, record_size, widen
from tokcache.store._segment import shm_path

Open = Callable[..., Store]
both_widths = pytest.mark.parametrize("id_bytes", ID_WIDTHS)
TOP = (1 << 24) - 1  # the largest id a 3-byte segment holds
# The static header of layout version 2 (before the id width joined it).
STATIC_V2 = struct.Struct("<8sII16sQQQQQIIQ")


def u32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


def _write(store: Store, offset: int, data: bytes) -> None:
    with open(shm_path(store.name), "r+b") as f:
        f.seek(offset)
        f.write(data)


def _static(store: Store) -> _layout.StaticHeader:
    with open(shm_path(store.name), "rb") as f:
        return _layout.unpack_static(f.read(_layout.HEADER_SIZE))


# --- conversion -------------------------------------------------------------------------


@given(st.lists(st.integers(0, U32_MAX), max_size=64))
def test_narrow_and_widen_match_a_reference(values: list[int]) -> None:
    ids = u32(*values)
    assert narrow(ids, 4) == ids and widen(ids, 4) == ids
    got = narrow(ids, 3)
    if any(v > TOP for v in values):
        assert got is None  # refused whole, never truncated
    else:
        assert got == b"".join(v.to_bytes(3, "little") for v in values)
        assert widen(got, 3) == ids
    # The one-pass C version (used when built) answers as the slices do.
    assert _layout._narrow(ids, 3) == got and _layout._narrow(ids, 4) == ids
    if _layout._native is not None:
        assert _layout._native.narrow(ids, 3) == got and _layout._native.narrow(ids, 4) == ids


def test_native_narrow_refuses_bad_arguments() -> None:
    if pure_python():
        pytest.skip("TOKCACHE_PURE_PYTHON=1: no native narrow")
    for ids, width in ((b"\0" * 5, 3), (u32(1), 2), (u32(1), 5)):
        with pytest.raises(ValueError):
            _layout._native.narrow(ids, width)


def test_id_bytes_for_vocabularies() -> None:
    assert id_bytes_for(151_669) == 3  # Qwen3
    assert id_bytes_for(128_256) == 3  # Llama 3.2
    assert id_bytes_for(1 << 24) == 3  # ids 0 .. 2**24 - 1
    assert id_bytes_for((1 << 24) + 1) == 4


# --- the store --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, 1, 2, 5, 8, -3, True, 3.0, "3"])
def test_open_refuses_other_widths(open_store: Open, shm_prefix: str, bad: object) -> None:
    with pytest.raises(ValueError):
        open_store(id_bytes=bad)
    assert not os.path.exists(shm_path(f"/{shm_prefix}-{FINGERPRINT}"))  # checked before creating


@both_widths
def test_ids_at_the_edge_of_24_bits_round_trip(open_store: Open, shm_prefix: str, id_bytes: int) -> None:
    store = open_store()
    edge = (0, 1, 255, 256, 0xFFFF, 0x10000, 0xFF00FF, 0x00FF00, TOP - 1, TOP)
    assert store.put(None, 0, u32(*edge), [(key("edge"), len(edge)), (key("half"), 5)], Kind.L1)
    assert store.put(key("edge"), len(edge), u32(TOP, 0, TOP), [(key("more"), 3)], Kind.L1)
    got = store.get(key("more"))
    assert isinstance(got, bytes) and got == u32(*edge, TOP, 0, TOP)
    assert store.get(key("half")) == u32(*edge[:5])
    with StoreReader.attach(prefix=shm_prefix, fingerprint=FINGERPRINT) as reader:
        assert reader.get(key("more")) == u32(*edge, TOP, 0, TOP)


@both_widths
def test_id_past_24_bits(open_store: Open, id_bytes: int) -> None:
    store = open_store()
    assert store.put(None, 0, u32(1, 2), [(key("p"), 2)], Kind.L1)
    used = store.stats().used_bytes
    for big in (1 << 24, 0x12345678, U32_MAX):
        # The entry uses only small ids, yet the record would hold the big one: all or nothing.
        fits = None is not store.put(None, 0, u32(7, big), [(key("root", big), 1)], Kind.L0)
        child = None is not store.put(key("p"), 2, u32(big), [(key("child", big), 1)], Kind.L1)
        assert fits is child is (id_bytes == 4)
        if fits:
            assert store.get(key("root", big)) == u32(7)
            assert store.get(key("child", big)) == u32(1, 2, big)
        else:
            assert store.get(key("root", big)) is None
            assert store.get(key("child", big)) is None
    if id_bytes == 3:
        stats = store.stats()
        assert (stats.puts, stats.used_bytes) == (1, used)  # nothing at all was written
        assert store.get(key("p")) == u32(1, 2)


def test_3_byte_records_store_a_quarter_less_ids(open_store: Open) -> None:
    ids = u32(*range(1000, 2000))
    used = {}
    for width in ID_WIDTHS:
        store = open_store(fingerprint=uuid.uuid4().hex, id_bytes=width)
        assert store.put(None, 0, ids, [(key("k"), 1000)], Kind.L1)
        used[width] = store.stats().used_bytes
        assert used[width] == record_size(1, width * 1000)
        assert store.get(key("k")) == ids
    assert used[4] - used[3] == 1000


@pytest.mark.parametrize("created, asked", [(3, 4), (4, 3)])
def test_reattach_keeps_the_header_width(open_store: Open, shm_prefix: str, created: int, asked: int) -> None:
    first = open_store(id_bytes=created)
    assert first.put(None, 0, u32(1, TOP), [(key("a"), 2)], Kind.L1)
    first.close()
    second = open_store(id_bytes=asked)
    assert second.attached_existing and second.id_bytes == created
    assert _static(second).id_bytes == created
    assert second.get(key("a")) == u32(1, TOP)
    assert (second.put(None, 0, u32(1 << 24), [(key("big"), 1)], Kind.L1) is not None) is (created == 4)
    with StoreReader.attach(prefix=shm_prefix, fingerprint=FINGERPRINT) as reader:
        assert reader.id_bytes == created
        assert reader.get(key("a")) == u32(1, TOP)


def test_layout_2_segment_is_replaced(open_store: Open, shm_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    first = open_store()
    assert first.put(None, 0, u32(1, 2), [(key("a"), 2)], Kind.L1)
    first.close()
    g = _layout.geometry_for(first.size)
    static = STATIC_V2.pack(
        _layout.MAGIC, 2, _layout.HEADER_SIZE, bytes.fromhex(FINGERPRINT), g.size, g.index_off,
        g.n_buckets, g.arena_off, g.arena_size, _layout.SLOT_SIZE, _layout.BUCKET_SLOTS, 1_700_000_000,
    ).ljust(_layout.STATIC_CHECK_OFF, b"\0")
    _write(first, 0, static + _layout.check_of(static))  # a valid header, as version 2 wrote it
    with pytest.raises(SegmentMismatch, match="layout version 2"):
        StoreReader.attach(prefix=shm_prefix, fingerprint=FINGERPRINT)
    with caplog.at_level(logging.WARNING):
        second = open_store(id_bytes=3)
    assert "layout version 2" in caplog.text
    assert not second.attached_existing
    assert second.get(key("a")) is None
    header = _static(second)
    assert (header.version, header.id_bytes, header.check_ok) == (_layout.LAYOUT_VERSION, 3, True)
    assert second.put(None, 0, u32(1, TOP), [(key("a"), 2)], Kind.L1)
    assert second.get(key("a")) == u32(1, TOP)


@pytest.mark.parametrize("width", [0, 2, 5])
def test_unknown_width_in_a_checked_header_is_replaced(open_store: Open, shm_prefix: str, width: int) -> None:
    first = open_store()
    first.close()
    _write(first, 0, _layout.pack_static(_layout.geometry_for(first.size), bytes.fromhex(FINGERPRINT), 0, width))
    with pytest.raises(SegmentMismatch, match="id width"):
        StoreReader.attach(prefix=shm_prefix, fingerprint=FINGERPRINT)
    second = open_store()
    assert not second.attached_existing and second.id_bytes == 4


def test_reader_and_direct_lookup_of_a_3_byte_segment_return_u32(open_store: Open, shm_prefix: str) -> None:
    store = open_store(id_bytes=3)
    values = [151_643, 0, 198, TOP, 42]
    assert store.put(None, 0, u32(*values[:2]), [(key("p"), 2)], Kind.L1)
    assert store.put(key("p"), 2, u32(*values[2:]), [(l0_key("hello"), 3, Kind.L0)], Kind.L1)
    with StoreReader.attach(prefix=shm_prefix, fingerprint=FINGERPRINT) as reader:
        assert reader.id_bytes == 3
        got = reader.get(l0_key("hello"))
        assert isinstance(got, bytes) and got == u32(*values)
    with DirectLookup(prefix=shm_prefix, fingerprint=FINGERPRINT) as lookup:
        assert lookup.get("hello") == u32(*values)
        assert lookup.get_ids("hello") == values
