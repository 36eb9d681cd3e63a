"""A record written in place by C (``_speedups.write_record``) is byte for byte the record
``_log.write_record``'s Python (the reference) makes: header, entries, ids, padding and SHA-256 check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokcache.native import pure_python
from tokcache.store._layout import ENTRY_SIZE, RECORD_SIZE, record_size
from tokcache.store._log import Link, write_record

# (write_record(native=True) is the Python where TOKCACHE_PURE_PYTHON=1 turns the C off: nothing to compare.)
pytestmark = pytest.mark.skipif(pure_python(), reason="TOKCACHE_PURE_PYTHON=1: no native record")

_key = st.binary(min_size=16, max_size=16).filter(lambda k: k != bytes(16))
_entry = st.tuples(_key, st.integers(0, 2**32 - 1), st.integers(0, 3), st.integers(0, 2**32 - 1),
                   st.integers(0, 2**24 - 1))
_link = st.none() | st.builds(Link, st.integers(0, 2**56 - 1), st.binary(min_size=8, max_size=8),
                              st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
                              st.integers(0, 2**56 - 1))


def _both(start: int, lsn: int, link: Link | None, entries: list[tuple[bytes, int, int, int, int]], ids: bytes,
          width: int, kind: int, flags: int, expiry: int, extra: int) -> tuple[bytearray, bytearray]:
    size = record_size(len(entries), len(ids)) + extra
    out = []
    for native in (False, True):
        buf = bytearray(b"\xa5" * (start + size + 16))  # not zero: every byte of the record is written
        write_record(buf, start, lsn, size, link, entries, ids, len(ids) // width, kind, flags, expiry, native=native)
        out.append(buf)
    return out[0], out[1]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 64), st.integers(0, 2**56 - 1), _link, st.lists(_entry, min_size=1, max_size=12),
       st.sampled_from([3, 4]), st.data(), st.integers(0, 3), st.sampled_from([0, 2]), st.integers(0, 2**32 - 1),
       st.sampled_from([0, 8, 24]))
def test_native_record_matches_the_python_one(start: int, lsn: int, link: Link | None,
                                              entries: list[tuple[bytes, int, int, int, int]], width: int,
                                              data: st.DataObject, kind: int, flags: int, expiry: int,
                                              extra: int) -> None:
    ids = data.draw(st.binary(max_size=300).map(lambda b: b[: len(b) // width * width]))
    py, c = _both(start, lsn, link, entries, ids, width, kind, flags, expiry, extra)
    assert c == py


def test_native_record_checks_its_bounds_and_entries_before_writing() -> None:
    entries = [(bytes(range(1, 17)), 1, 1, 0, 0)]
    size = record_size(1, 12)
    buf = bytearray(size)
    with pytest.raises(ValueError, match="does not fit the buffer"):
        write_record(buf, 8, 0, size, None, entries, bytes(12), 4, 1, 0, 0)
    with pytest.raises(ValueError, match="do not fit its size"):
        write_record(buf, 0, 0, RECORD_SIZE + ENTRY_SIZE, None, entries, bytes(12), 4, 1, 0, 0)
    with pytest.raises(ValueError, match="do not fit its size"):  # the header's size field is a u32
        write_record(buf, 0, 0, 2**32 + 8, None, entries, bytes(12), 4, 1, 0, 0)
    size = record_size(2, 12)
    buf = bytearray(size)
    before = bytes(buf)
    for bad, error in (((b"short", 1, 1, 0, 0), TypeError), ((bytes(range(1, 17)), 1, 300, 0, 0), OverflowError),
                       ((bytes(range(1, 17)), 1, 1, 0, 2**24), OverflowError),
                       ((bytes(range(1, 17)), 1), TypeError)):
        with pytest.raises(error):
            write_record(buf, 0, 0, size, None, [*entries, bad], bytes(12), 4, 1, 0, 0)  # type: ignore[list-item]
        assert buf == before  # nothing written
