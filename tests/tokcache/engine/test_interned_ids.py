"""One int object per id value in a client (tokcache.engine.ids.intern_ids): equal lists, shared ints."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokcache.engine import ids as ids_mod
from tokcache.engine.ids import BYTES, INTERNED_IDS, LISTS, intern_ids, unpack_interned
from tokcache.ids import pack_ids, unpack_ids
from tokcache.native import pure_python

native = pytest.mark.skipif(pure_python(), reason="TOKCACHE_PURE_PYTHON=1: no native ids")


def fresh(values: list[int]) -> list[int]:
    """New int objects for ``values`` (as an encoder makes them)."""
    return [int(str(v)) for v in values]


@given(st.lists(st.integers(-5, INTERNED_IDS + 5), max_size=100))
def test_interning_keeps_the_values(values: list[int]) -> None:
    ids = fresh(values)
    assert intern_ids(ids) is ids and ids == values
    assert unpack_interned(pack_ids([v for v in values if v >= 0])) == [v for v in values if v >= 0]


@native
def test_equal_ids_share_one_object_across_lists_and_unpacking() -> None:
    values = [random.randrange(300, 150_000) for _ in range(500)]
    a, b = intern_ids(fresh(values)), intern_ids(fresh(values))
    assert all(x is y for x, y in zip(a, b, strict=True))
    c = unpack_interned(pack_ids(values))
    assert c == values and all(x is y for x, y in zip(a, c, strict=True))
    assert LISTS.own(fresh(values))[7] is a[7]
    assert LISTS.from_u32(pack_ids(values)).parts[0][0][3] is a[3]


@native
def test_what_is_not_an_interned_id_is_left_as_it_is() -> None:
    class Id(int):
        pass

    big, sub = INTERNED_IDS + 7, Id(5)
    ids = [big, -1, sub, True, 5]
    kept = list(ids)
    intern_ids(ids)
    assert ids == [big, -1, 5, True, 5]
    assert ids[0] is kept[0] and ids[2] is sub and ids[3] is True  # not exact ints in range: untouched
    assert unpack_ids(pack_ids([big])) == unpack_interned(pack_ids([big]))
    with pytest.raises(ValueError):
        ids_mod._native.unpack(b"\0" * 5, ids_mod._interned())
    with pytest.raises(TypeError):
        ids_mod._native.intern((1, 2), ids_mod._interned())


def test_the_sidecar_format_keeps_lists_as_they_are() -> None:
    ids = fresh([1000, 2000])
    assert BYTES.own(ids) is ids
